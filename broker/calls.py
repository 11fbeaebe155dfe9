"""Call records in Redis: submit, claim, transition, lease and reap, each one atomic script.

A record is the RQ job hash with our ``h_*`` fields, the envelope inside its ``data``. Every write takes
an optional ``pipeline``; only the creator of a pipeline executes it.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
import redis.asyncio
import redis.asyncio.cluster
import structlog
from redis.client import Pipeline

from . import events, keys, pipes, poison, scripts
from .codec import pack, raw, text, unpack
from .connection import is_cluster
from .envelope import Envelope, fairness_of
from .errors import DecodeError, IllegalTransition, QueueFull
from .idempotency import conflict, key_name, request_digest
from .logs import utc_text
from .ratelimits import RateLimit
from .settings import DEFAULT_BATCH_SHARE, DEFAULT_RESULT_TTL
from .states import RQ_STATUS, STEP_CODES, TERMINAL, State, sources

RQ_FUNC = "workers.entry.run_call"


def lease_deadline(seconds: float) -> int:
    """A lease deadline ``seconds`` from now, in whole seconds: Redis keeps small sorted sets as listpacks,
    where a fractional score is printed and parsed back on every access."""
    return math.ceil(time.time() + seconds)


def waiting_score() -> int:
    """Where a call joins the line for a slot: now in whole microseconds (an integer score)."""
    return time.time_ns() // 1000


rq_time = utc_text  # a time as RQ keeps it (UTC, microseconds)


@dataclass(frozen=True)
class CallInfo:
    """What every event of a call repeats; built once per call."""

    call_id: str
    trace_id: str
    span_id: str
    kind: str
    name: str
    session_id: str | None
    channel: str
    ckey: str
    queue: str

    @classmethod
    def of(cls, env: Envelope, ckey: str, span_id: str | None = None) -> CallInfo:
        return cls(
            env.call_id, env.trace_id, span_id or env.parent_span_id, env.kind, env.name,
            env.context.get("session_id"), env.channel, ckey, env.queue,
        )


# A move not written yet: (state, event detail, when it happened).
Step = tuple[State, "dict[str, Any] | None", float]


@dataclass(frozen=True)
class Claimed:
    """A call a worker took from a queue."""

    call_id: str
    data: bytes
    attempt: int


def job_fields(env: Envelope, *, ckey: str, max_attempts: int, timeout: float) -> dict[str, Any]:
    """The RQ job hash (RQ's own fields, so ``rq info``/``Job.fetch`` work) plus ours."""
    stamp = rq_time(time.time())
    fkey, klass = fairness_of(env)
    fields = {
        "created_at": stamp,
        "enqueued_at": stamp,
        "data": env.job_data(RQ_FUNC),
        "origin": env.queue,
        "description": f"hermes {env.kind} {env.name}",
        "timeout": int(timeout) + 1,
        "result_ttl": 86400,
        "failure_ttl": 86400,
        "worker_name": "",
        "started_at": "",
        "ended_at": "",
        keys.F_ATTEMPT: 1,
        keys.F_MAX_ATTEMPTS: max_attempts,
        keys.F_CHANNEL: env.channel,
        keys.F_QUEUE: keys.queue(env.queue),
        keys.F_CKEY: ckey,
        keys.F_KIND: env.kind,
        keys.F_TOOL: env.name,
        keys.F_TRACE: env.trace_id,
        keys.F_FKEY: fkey,
        keys.F_CLASS: klass,
    }
    principal = env.context.get("principal")
    if principal:  # (one HGET away for the HTTP API's checks)
        fields[keys.F_PRINCIPAL] = principal
    session = env.context.get("session_id")
    if session:  # (the events a retry, a cancel or the reaper make carry it too)
        fields[keys.F_SESSION] = session
    return fields


def failure_entry(info: CallInfo, error: dict[str, Any], worker: str, principal: str | None) -> bytes:
    """A failed call as ``hermes:failures`` lists it (status's recent failures)."""
    return pack({
        "call_id": info.call_id, "name": info.name, "kind": info.kind, "error": error, "ts": time.time(),
        "worker": worker, "principal": principal,
    })  # fmt: skip


def stats_name(conn: Any, label: str, value: str) -> Any:
    """1 when ``value`` is one of the values hermes:stats shows of ``label`` (admitted now unless the label has
    ``keys.STATS_MAX_NAMES`` of them), else 0: it counts as ``keys.STATS_OTHER`` (an asyncio client: awaitable)."""
    return conn.eval(scripts.STATS_NAME, 1, keys.stats_names(label), value, keys.STATS_MAX_NAMES)


def push_failure(pipe: Any, entry: bytes) -> None:
    """Queue on ``pipe`` the listing of a ``failure_entry``, the list kept to ``FAILURES_KEPT``."""
    pipe.lpush(keys.FAILURES, entry)
    pipe.ltrim(keys.FAILURES, 0, keys.FAILURES_KEPT - 1)


def envelope_of(data: bytes) -> Envelope:
    """Decode the envelope out of the RQ job's ``data`` field."""
    job = unpack(data)
    if not isinstance(job, list) or len(job) != 4 or not isinstance(job[2], list) or not job[2]:
        raise DecodeError("job data is not a hermes call")
    return Envelope.from_dict(job[2][0])


def ending(conn: Any, call_id: str) -> Any:
    """An ended call's terminal event: the one kept at ``keys.ended``, else the last terminal one of its
    history (``workers.keep_history``)."""
    last = conn.get(keys.ended(call_id))
    if last is not None:
        return events.decode(raw(last), call_id)
    ends = [e for e in events.history(conn, call_id) if e.terminal]
    return ends[-1] if ends else None


def read_record(conn: Any, call_id: str) -> dict[str, Any] | None:
    """The call's record as plain values (state, attempt, result, error, ...); an ended call's come from
    its terminal event, and it has no envelope any more (``request_dropped`` True)."""
    stored = conn.hgetall(keys.job(call_id))
    if not stored:
        return None
    rec = {text(k): v for k, v in stored.items()}
    out: dict[str, Any] = {
        "call_id": call_id,
        "state": text(rec.get(keys.F_STATE)),
        "attempt": _int(rec.get(keys.F_ATTEMPT)),
        "seq": _int(rec.get(keys.F_SEQ)),
        "kind": text(rec.get(keys.F_KIND)),
        "name": text(rec.get(keys.F_TOOL)),
        "trace_id": text(rec.get(keys.F_TRACE)),
        "channel": text(rec.get(keys.F_CHANNEL)),
        "worker": text(rec.get(keys.F_WORKER) or rec.get("worker_name")),
        "queue": text(rec.get("origin")) or keys.tag_in(call_id).strip("{}"),
        "created_at": text(rec.get("created_at")),
        "ended_at": text(rec.get("ended_at")),
    }
    if out["state"] in _ENDED:
        end = ending(conn, call_id)
        if end is not None:
            out["seq"] = max(out["seq"], end.seq)
            out["trace_id"] = out["trace_id"] or end.trace_id
            out["ended_at"] = out["ended_at"] or rq_time(end.ts)
            for outcome in ("error", "result"):  # (in this order: a record's keys keep it)
                if outcome in end.detail:
                    out[outcome] = end.detail[outcome]
    if rec.get(keys.F_RESULT) is not None:
        out["result"] = unpack(raw(rec[keys.F_RESULT]))
    elif out["state"] == State.DONE.value:
        out.setdefault("result", None)
    if rec.get("data"):
        try:
            out["envelope"] = envelope_of(raw(rec["data"]))
        except Exception:  # noqa: BLE001 - a record with a bad payload is still a record
            out["envelope"] = None
    elif out["state"] in _ENDED:
        out["envelope"] = None
        out["request_dropped"] = True
    return out


_ENDED = frozenset(s.value for s in TERMINAL)


def _int(value: Any) -> int:
    """A counter field as a number; 0 for one that is not (a damaged record is still shown)."""
    try:
        return int(value or 0)
    except ValueError:
        return 0


log = structlog.get_logger("hermes.calls")
_ABSENT_PATIENCE = 30.0  # seconds a recheck waits out a moving slot (a migration of one slot)
SUBMIT_TTL = 7 * 86400

# Job hash fields of a call submitted under an idempotency key: the key and the digest of what was asked.
F_IDEM = "h_idem"
F_DIGEST = "h_digest"

# Fair dispatch (broker/lua/slots.lua): a weight-1 fairness key's tag step (weight w: UNIT / w, an integer
# score), and the scale of the batch share passed to the scripts.
UNIT = 1_000_000
SHARE_SCALE = 10_000

# Reasons a transition script refused.
MISSING, FENCED, WRONG_STATE = -1, -2, -3


HAND_BACK_SAFETY = 5.0  # seconds: see Calls.hand_back


class Calls:
    """Scripted operations on call records: submission, claims, leases, reaping and transitions."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._claim = conn.register_script(scripts.CLAIM)
        self._reap = conn.register_script(scripts.TAKE_DUE)
        self._strict_ids = is_cluster(conn)  # (see claim.lua: ids of another slot are not looked up)
        self._submit = conn.register_script(scripts.SUBMIT)
        # Sharded channels (in the call's slot) on a cluster, where PUBLISH would reach every node.
        self.publish = "SPUBLISH" if is_cluster(conn) else "PUBLISH"
        self.listed: set[str] = set()  # queues this process added to rq:queues
        self.is_async = isinstance(conn, (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster))
        self._transition = conn.register_script(scripts.for_server(conn, scripts.TRANSITION))
        self.keep_history = False  # `workers.keep_history`, set by the owner
        self._queue_keys: dict[tuple[str, str], tuple[QueueKeys, str]] = {}  # (see _keys_of)

    # -- submission ------------------------------------------------------------------------------

    def submit(
        self, env: Envelope, *, ckey: str, queue_size: int, max_attempts: int, timeout: float,
        concurrency: int = -1, weight: float = 1.0, batch_share: float = DEFAULT_BATCH_SHARE,
        key_size: int = -1, rate_limit: RateLimit | None = None, estimate: int = 0,
        pipeline: Pipeline | None = None, extra: tuple[Any, ...] = (),
    ) -> Any:
        """Admit a call with its ``pending`` event: onto its queue with a slot of ``ckey`` when one is free
        (``concurrency`` -1 = no limit) and its ``rate_limit`` allows it (``estimate`` tokens reserved),
        else waiting (at most ``queue_size``; at most ``key_size`` of its fairness key and class, -1 = no
        such bound) for its fair turn. Returns the script's reply.
        ``extra``: more field/value pairs for the job hash (a batch's call: ``h_batch``)."""
        info = CallInfo.of(env, ckey)
        now = time.time()
        ev = events.payload(
            call_id=env.call_id, state=State.PENDING, trace_id=info.trace_id, span_id=info.span_id, attempt=1,
            kind=env.kind, name=info.name, session_id=info.session_id, detail={"queue": env.queue}, ts=now,
        )
        fields = job_fields(env, ckey=ckey, max_attempts=max_attempts, timeout=timeout)
        fields[keys.F_STEPS] = "#1" + step_text(State.PENDING, 1, now, 0)  # (the pending event is seq 1)
        fkey, klass = fields[keys.F_FKEY], fields[keys.F_CLASS]
        flat = [x for k, v in fields.items() for x in (k, "" if v is None else v)]
        idem = env.options.idempotency_key
        digest = ""
        tag = keys.tag(env.queue)
        idem_key = key_name(env)
        if idem:
            digest = request_digest(env)
            flat += [F_IDEM, idem_key, F_DIGEST, digest]
        flat += extra
        # Listed in rq:queues (``rq info``) once per process (an asyncio client awaits its own SADD).
        if not self.is_async and env.queue not in self.listed:
            self.conn.sadd(keys.RQ_QUEUES, keys.queue(env.queue))
            self.listed.add(env.queue)
        of, wake = self._keys_of(env.queue, ckey)
        return pipes.script(
            self._submit,
            [
                keys.job(env.call_id), of.queue, keys.history(env.call_id), of.waiting,
                idem_key, of.slots, of.limits, of.waiting_batch, of.fair,
                of.rate, of.rate_log, of.rate_due, keys.rates(tag),
            ],
            [
                env.call_id, ev, SUBMIT_TTL, queue_size, waiting_score(), env.channel, digest, concurrency,
                ckey, wake, self.publish, keys.job(""), fkey, klass, max(1, round(UNIT / weight)),
                round(batch_share * SHARE_SCALE), key_size,
                rate_limit.argv() if rate_limit is not None else "",
                estimate if rate_limit is not None else 0,
                *flat,
            ],
            pipeline,
        )  # fmt: skip

    @staticmethod
    def check_submit(reply: Any, ckey: str, queue_size: int, env: Envelope | None = None) -> tuple[bool, str]:
        """Turn a SUBMIT reply into (accepted_new, call_id) or raise QueueFull / IdempotencyConflict; with
        ``env``, an existing call of another tool or kind under the same idempotency key is a conflict too."""
        code, value = int(reply[0]), reply[1]
        if code == -3:
            fkey = text(reply[3])
            raise QueueFull(
                f"queue for {ckey!r} is full for fairness key {fkey!r} ({int(value)} waiting, "
                f"limit {int(reply[2])} per key: fairness.queue_size_per_key)",
                key=ckey, fairness_key=fkey, limit=int(reply[2]), depth=int(value),
            )
        if code == -1:
            raise QueueFull(
                f"queue for {ckey!r} is full ({int(value)} waiting, limit {queue_size})",
                key=ckey, limit=queue_size, depth=int(value),
            )
        existing = Calls.existing_call(reply)
        if code == -2 or (
            code == 0 and env is not None and existing is not None and existing != (env.name, env.kind)
        ):
            name, kind = existing or ("", "")
            raise conflict(env, text(value), name, kind)
        return code == 1, text(value)

    @staticmethod
    def existing_call(reply: Any) -> tuple[str, str] | None:
        """(tool or model, kind) of the existing call an idempotent SUBMIT reply names, if it says."""
        if int(reply[0]) in (0, -2) and len(reply) >= 4:
            return text(reply[2]), text(reply[3])
        return None

    def wake_channel(self, queue: str) -> str:
        """The wake-up channel of ``queue`` (pub/sub is shared by every DB of a server: scoped to ours)."""
        return keys.channel(self.conn, keys.wake(keys.base_queue(queue)))

    # -- workers ---------------------------------------------------------------------------------

    def claim(self, queues: list[str], n: int, worker: str, lease: float, connection: Any = None) -> list[Claimed]:
        """Take up to ``n`` pending calls off the queues (in order), leased to ``worker``: one script per
        queue, the next queue only while fewer than ``n`` came. A queue whose slot is moving to another
        node (``pipes.moving``) is skipped this time. ``connection``: one the caller keeps for its claims
        alone (a worker's dispatcher), sent through ``pipes`` on a plain Redis."""
        out: list[Claimed] = []
        fast = connection is not None and pipes.FAST  # (a cluster client keeps no connection)
        for q in queues:
            keys_ = [keys.leases(keys.tag(q)), keys.queue(q)]
            args = [*self.claim_args(q, n - len(out), worker, lease), keys.job("")]
            try:
                if fast:
                    pipe = self.conn.pipeline(transaction=False)
                    pipes.script(self._claim, keys_, args, pipe)
                    (reply,) = pipes.execute(pipe, connection)
                    if isinstance(reply, Exception):
                        raise reply
                else:
                    reply = self._claim(keys=keys_, args=args)
            except redis.RedisError as e:
                if not pipes.moving(e):
                    raise
                continue  # this queue's slot is moving to another node: claimed again once it is there
            out += self.claimed(q, reply[0], reply[1])
            if len(out) >= n:
                break
        return out

    def claim_args(self, queue: str, n: int, worker: str, lease: float) -> list[Any]:
        """CLAIM's arguments but the job prefix, also TRANSITION's ``take`` of ``n`` calls of ``queue``
        (followed there by the taker's share: see transition.lua)."""
        tag = keys.tag(queue)
        deadline, now = lease_deadline(lease), rq_time(time.time())
        return [n, worker, deadline, now, keys.slots(tag, ""), tag + "." if self._strict_ids else ""]

    def claimed(self, queue: str, reply: list[Any], absent: list[bytes]) -> list[Claimed]:
        """The calls a claim took (claim_calls' reply): ids not found here are asked again
        (``recheck_absent``), an unreadable record is settled alone."""
        if absent:
            gone = recheck_absent(self.conn, absent, requeue=keys.queue(queue))
            for cid in gone:
                DROPPED.warn(queue, cid)
            if gone:
                self._stale_slots(queue, gone)
        out: list[Claimed] = []
        for i in range(0, len(reply), 3):
            cid, data, attempt = reply[i], reply[i + 1], reply[i + 2]
            try:
                out.append(Claimed(cid.decode(), data or b"", int(attempt or 1)))
            except (TypeError, ValueError):  # one unreadable record is settled alone (broker.poison)
                poison.settle(self, cid, poison.row_problem({"h_attempt": attempt}))  # type: ignore[arg-type]
        return out

    def _stale_slots(self, queue: str, gone: list[bytes]) -> None:
        # A queued call holds its slot (score +inf) until it ends; one whose record was deleted behind our
        # back (by hand, or a flush of its key) never ends, so its slot would stay taken for good. Which
        # key's slot it held went with the record: it is marked stale in each slot set of the queue's tag
        # (XX: only where it is), so the next sweep frees it and promotes the call next in line.
        tag = keys.tag(queue)
        try:
            ckeys = self.conn.hkeys(keys.limits(tag))
            with self.conn.pipeline(transaction=False) as pipe:
                for ckey in ckeys:
                    for cid in gone:
                        pipe.zadd(keys.slots(tag, text(ckey)), {cid: 0}, xx=True)
                pipe.execute()
        except redis.RedisError as e:
            if not pipes.moving(e):
                raise  # (a tag mid-migration: its marks are skipped, the slots stay taken)

    def extend_leases(self, runs: Sequence[CallInfo], lease: float, pipeline: Pipeline | None = None) -> None:
        """Push the lease deadline of calls still running here (only those still leased), and of the
        concurrency slots they hold."""
        if not runs:
            return
        deadline = lease_deadline(lease)
        target = pipeline if pipeline is not None else self.conn
        by_key: dict[str, dict[str, int]] = {}  # a queue's leases and a concurrency key's slots
        for info in runs:
            tag = keys.tag(info.queue)
            by_key.setdefault(keys.leases(tag), {})[info.call_id] = deadline
            by_key.setdefault(keys.slots(tag, info.ckey), {})[info.call_id] = deadline
        for key, members in by_key.items():
            target.zadd(key, members, xx=True)

    def reap(self, queues: Sequence[str], lease: float, limit: int = 100) -> list[dict[str, Any]]:
        """Expired leases of calls on ``queues``, taken over by this reaper for one more lease while it
        settles them."""
        now = time.time()
        out = []
        for q in queues:
            try:
                reply = self._reap(
                    keys=[keys.leases(keys.tag(q))],
                    args=[now, lease_deadline(lease), limit, keys.job(""), "reap"],
                )
            except redis.RedisError as e:
                if not pipes.moving(e):
                    raise
                continue  # this queue's slot is moving: its leases are looked at next time
            recheck_absent(self.conn, reply.pop(), zset=keys.leases(keys.tag(q)))
            for i in range(0, len(reply), 7):
                cid, state, attempt, max_att, queue, cancel, ckey = (text(v) for v in reply[i : i + 7])
                try:
                    numbers = int(attempt or 1), int(max_att or 1)
                except ValueError:  # one unreadable record is settled alone (broker.poison)
                    problem = poison.row_problem({"h_attempt": attempt, "h_max_attempts": max_att})
                    poison.settle(self, reply[i], problem)  # type: ignore[arg-type]
                    continue
                # (a record without h_queue: the id's tag is its queue's, so its lease can go)
                queue = queue or keys.RQ_QUEUE.format(keys.tag_in(cid) or keys.tag(q))
                out.append({
                    "call_id": cid, "state": state, "attempt": numbers[0], "max_attempts": numbers[1],
                    "queue": queue, "cancel": cancel == "1", "ckey": ckey,
                })  # fmt: skip
        return out

    # -- transitions -----------------------------------------------------------------------------

    def transition(
        self, info: CallInfo, target: State | None, *, attempt: int, detail: dict[str, Any] | None = None,
        fence: bool = True, from_states: frozenset[State] | None = None, lease: float | str | None = None,
        requeue: bool = False, requeue_first: bool = False, schedule_at: float | None = None,
        fields: dict[str, Any] | None = None, ttl: int | None = None, event_type: str = events.TRANSITION,
        current: State | None = None, pipeline: Pipeline | None = None, via: Sequence[Step] = (),
        ts: float | None = None, unleased: bool = False, used_tokens: int | None = None, sent: bool = True,
        take: Sequence[Any] = (),
    ) -> Any:
        """Move a call to ``target`` (or publish a non-state event when None), atomically with its event.

        ``via``: earlier moves not written yet, ``(state, detail, ts)`` each, the first from ``current``,
        written first. ``unleased``: only from ``pending`` while no worker holds the call. Ending (or
        ``retrying``) releases the call's slot and promotes the next waiting call, settling its rate
        limiter with ``used_tokens`` (``sent`` False: given back); ``requeue`` admits it again. ``take``
        (``claim_args``): a releasing worker takes next calls in the same script (``claimed`` reads them).
        """
        release = target is not None and (target in TERMINAL or target is State.RETRYING)
        if via and target is None:
            raise ValueError("earlier moves ride only with a state change")
        early: list[bytes] = []
        moves = []  # the steps of the transitions recorded (broker/lua/transition.lua: `moves`, `move`)
        first: frozenset[State] | None = None  # what the state in Redis must be: the first move's sources
        for state_, detail_, ts_ in via:  # each checked as if it were written alone
            first = self._check_move(current, state_, from_states if first is None else None, first)
            ts_ = time.time() if ts_ is None else ts_
            early.append(self._event(info, str(state_), attempt, events.TRANSITION, detail_, ts_))
            moves.append(step_text(state_, attempt, ts_, len(early) - 1))
            current = state_
        if target is not None:
            allowed = self._check_move(current, target, from_states if first is None else None, first)
            src = "pending!" if unleased else _joined(allowed)
            state = str(target)
            if target in TERMINAL:  # (the script keeps only what an ended record needs: see transition.lua)
                lease = "-"
                ttl = ttl or DEFAULT_RESULT_TTL
        else:
            src, state = "", ""
        ts = time.time() if ts is None else ts
        ev = self._event(info, state or (str(current) if current else ""), attempt, event_type, detail, ts)
        move = step_text(state, attempt, ts, len(early)) if state and event_type == events.TRANSITION else ""
        flat: list[Any] = [len(early), *early]
        for pair in (fields or {}).items():
            flat += pair
        of_queue, wake = self._keys_of(info.queue, info.ckey)
        return pipes.script(
            self._transition,
            [keys.job(info.call_id), keys.history(info.call_id), *of_queue, keys.ended(info.call_id)],
            [
                info.call_id, ev, "" if ttl is None else ttl, str(attempt) if fence else "", src,  # 1-5
                state, RQ_STATUS[target] if target is not None else "", "" if lease is None else lease,  # 6-8
                "1" if requeue else "", "first" if requeue_first else "", info.channel,  # 9-11
                "1" if release else "", info.ckey, "" if schedule_at is None else schedule_at,  # 12-14
                wake, self.publish, keys.job(""), waiting_score() if requeue else "",  # 15-18
                "-" if not sent else "" if used_tokens is None else used_tokens,  # 19
                "1" if self.keep_history else "", "".join(moves), move,  # 20-22
                *(take or _NO_TAKE),  # 23-30
                *flat,  # (ARGV 31 on: how many earlier events, those events, then the job fields)
            ],
            pipeline,
        )  # fmt: skip

    def _keys_of(self, queue: str, ckey: str) -> tuple[QueueKeys, str]:
        """The keys of a queue and concurrency key (``QueueKeys``) and the queue's wake-up channel, made once
        per pair: every move of every call names the same twelve."""
        got = self._queue_keys.get((queue, ckey))
        if got is None:
            tag = keys.tag(queue)
            got = (
                QueueKeys(
                    keys.leases(tag), keys.waiting(tag, ckey), keys.slots(tag, ckey), keys.limits(tag),
                    keys.scheduled(tag), keys.queue(queue), keys.waiting_batch(tag, ckey), keys.fair(tag, ckey),
                    keys.rate(tag, ckey), keys.rate_log(tag, ckey), keys.rate_due(tag),
                ),
                self.wake_channel(queue),
            )  # fmt: skip
            if len(self._queue_keys) >= 4096:  # (pairs are tools and models: a bound that is never reached)
                self._queue_keys.clear()
            self._queue_keys[(queue, ckey)] = got
        return got

    # -- named operations (each one TRANSITION) ----------------------------------------------------

    # A worker moves the call it holds (fenced by ``attempt``, ``current`` its state), with the moves
    # ``via`` not written yet; a terminal ``target`` ends it (``fields``: result, ``ttl``: how long the
    # record stays). The same operation, named for the worker's side.
    move = transition

    def note(
        self, info: CallInfo, event_type: str, detail: dict[str, Any], *, attempt: int, current: State | None,
        ts: float | None = None, pipeline: Pipeline | None = None,
    ) -> Any:
        """An event that changes no state (progress, a stream delta), fenced like a move."""
        return self.transition(
            info, None, attempt=attempt, detail=detail, event_type=event_type, current=current, ts=ts,
            pipeline=pipeline,
        )

    def finish(
        self, info: CallInfo, target: State, *, attempt: int, current: State, error: dict[str, Any], ttl: int
    ) -> Any:
        """End a call with ``error`` (``failed`` or ``cancelled``) on behalf of a lost worker."""
        return self.transition(
            info, target, attempt=attempt, current=current, detail={"error": error}, ttl=ttl
        )

    def retry(
        self, info: CallInfo, *, attempt: int, current: State, detail: dict[str, Any],
        due: float | None = None, pipeline: Pipeline | None = None,
    ) -> Any:
        """The attempt ends ``retrying``: its lease and slot go, the next attempt is counted and, with
        ``due``, put on the schedule."""
        return self.transition(
            info, State.RETRYING, attempt=attempt, current=current, detail=detail, lease="-", schedule_at=due,
            fields={keys.F_ATTEMPT: attempt + 1}, pipeline=pipeline,
        )

    def requeue(
        self, info: CallInfo, *, attempt: int, first: bool = False, pipeline: Pipeline | None = None
    ) -> Any:
        """A ``retrying`` call is admitted again: a free slot, else it waits for its fairness key's next
        turn (``first``: before every waiting call)."""
        return self.transition(
            info, State.PENDING, attempt=attempt, requeue=True, requeue_first=first, lease="-",
            current=State.RETRYING, pipeline=pipeline,
        )

    def hand_back(
        self, info: CallInfo, *, attempt: int, current: State, reason: str, free: bool = False
    ) -> bool:
        """A running call goes back before every waiting call as its next attempt (``free``: an
        attempt that does not count, its worker stopped); False when it was no longer this attempt's.
        The move is also put on the retry schedule ``HAND_BACK_SAFETY`` seconds on, which the requeue
        takes off: should this process stop between the two, a DUE scheduler requeues the call."""
        reply = self.retry(
            info, attempt=attempt, current=current, detail={"reason": reason, "next_attempt": attempt + 1},
            due=time.time() + HAND_BACK_SAFETY,
        )
        if int(reply[0]) <= 0:
            return False
        if free:
            self.conn.hincrby(keys.job(info.call_id), keys.F_MAX_ATTEMPTS, 1)
        self.requeue(info, attempt=attempt + 1, first=True)
        return True

    def cancel_unleased(
        self, info: CallInfo, *, attempt: int, error: dict[str, Any], pipeline: Pipeline | None = None,
        retrying: bool = False,
    ) -> Any:
        """A caller cancels a call still ``pending`` that no worker holds, or (``retrying``) one waiting for
        its next attempt (its schedule entry then just leaves: the retry finds it ended)."""
        waiting = State.RETRYING if retrying else State.PENDING
        return self.transition(
            info, State.CANCELLED, attempt=attempt, fence=False, from_states=frozenset({waiting}),
            unleased=not retrying, detail={"error": error}, pipeline=pipeline,
        )

    @staticmethod
    def _check_move(
        current: State | None, target: State, from_states: frozenset[State] | None,
        first: frozenset[State] | None,
    ) -> frozenset[State]:
        """Refuse an illegal move; returns the sources the script checks (the first move's)."""
        allowed = from_states if from_states is not None else sources(target)
        if current is not None and current not in allowed:
            raise IllegalTransition(
                f"illegal transition {current} -> {target}", current=str(current), target=str(target)
            )
        return first if first is not None else allowed

    @staticmethod
    def _event(
        info: CallInfo, state: str, attempt: int, event_type: str, detail: dict[str, Any] | None,
        ts: float | None,
    ) -> bytes:
        return events.payload(
            call_id=info.call_id, state=state, trace_id=info.trace_id, span_id=info.span_id, attempt=attempt,
            kind=info.kind, name=info.name, session_id=info.session_id, type=event_type, detail=detail, ts=ts,
        )

    def load_scripts(self) -> None:
        """Load the scripts the hot paths queue into pipelines, so that none is refused (NOSCRIPT) and
        rerun after the commands queued behind it."""
        for script in (self._transition, self._submit):
            self.conn.script_load(script.script)

    def record(self, call_id: str) -> dict[str, Any] | None:
        """The call's record as plain values (``read_record``)."""
        return read_record(self.conn, call_id)


class QueueKeys(NamedTuple):
    """The keys of one queue and concurrency key, in TRANSITION's KEYS order (3 to 13)."""

    leases: str
    waiting: str
    slots: str
    limits: str
    scheduled: str
    queue: str
    waiting_batch: str
    fair: str
    rate: str
    rate_log: str
    rate_due: str


_NO_TAKE = ('',) * 8  # TRANSITION's ARGV 23-30 when it takes no call


def step_text(state: str, attempt: int, ts: float, index: int) -> str:
    """One transition as the record's ``h_steps`` keeps it, ``<state's code><attempt> <µs since the
    epoch, hexadecimal> <its event's place in its write>;``: what an ended call's ``steps`` are read from
    (``broker.events``). TRANSITION puts ``#<seq of the write's first event>`` before a write's steps, so
    each step's seq is known: a follower resuming after seq N is given exactly the moves after it."""
    return f"{STEP_CODES[state]}{attempt} {round(ts * 1e6):x} {index};"


@functools.lru_cache(maxsize=256)
def _joined(states: frozenset[State]) -> str:
    """The sources a script checks, as its ``a,b,c`` argument (a few distinct sets, each joined once)."""
    return ",".join(sorted(states))


def recheck_absent(conn: Any, ids: list[bytes], *, requeue: str | None = None, zset: str | None = None) -> list[bytes]:
    """Ids a script found no record of, asked again where a cluster's redirections are followed: a
    record on its way to another node keeps its place (back at the head of ``requeue``, or left in
    ``zset``), one that is gone leaves ``zset``. An id without the tag of ``requeue``'s queue is never
    looked up. Returns the ids dropped."""
    prefix = keys.tag_in(requeue).encode() + b"." if requeue is not None else b""
    gone = []
    for raw_id in ids:
        cid = text(raw_id)
        # A slot mid-migration bounces single-key commands too: asked again, so a popped id is never dropped.
        patience = pipes.for_seconds(_ABSENT_PATIENCE)
        if raw(raw_id).startswith(prefix) and pipes.patiently(patience, conn.hexists, keys.job(cid), keys.F_STATE):
            if requeue is not None:
                pipes.patiently(patience, conn.lpush, requeue, cid)
            continue
        gone.append(raw(raw_id))
        if zset is not None:
            pipes.patiently(patience, conn.zrem, zset, cid)
    return gone


class DroppedIds:
    """One warning for each id drained off a queue that names no call there, at most ``burst`` a minute
    per process; the rest are counted into the next warning."""

    def __init__(self, burst: int = 20, window: float = 60.0) -> None:
        self.burst, self.window = burst, window
        self._since, self._sent, self._suppressed = 0.0, 0, 0

    def warn(self, queue: str, raw_id: bytes) -> None:
        now = time.monotonic()
        if now - self._since >= self.window:
            self._since, self._sent = now, 0
        if self._sent >= self.burst:
            self._suppressed += 1
            return
        self._sent += 1
        more, self._suppressed = self._suppressed, 0
        shown = raw_id.decode(errors="replace")
        log.warning(
            "dropped an id on queue that names no call of it", queue=queue,
            call_id=shown[:40] + ("..." if len(shown) > 40 else ""),
            **({"suppressed_before": more} if more else {}),
        )


DROPPED = DroppedIds()
