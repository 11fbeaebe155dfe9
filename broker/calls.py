"""Call records in Redis: submit, transition, claim, lease and reap, each one atomic script.

What a record holds (``CallInfo``, the job fields, the envelope in it, times and scores) is in
``broker.records``.

Every write takes an optional ``pipeline``; only the creator of a pipeline executes it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.client import Pipeline

from . import events, keys, pipes, poison, scripts, upkeep
from .codec import raw, text
from .envelope import Envelope
from .errors import IllegalTransition, QueueFull
from .idempotency import conflict, request_digest
from .records import CallInfo, Claimed, Step, job_fields, lease_deadline, read_record, rq_now, waiting_score
from .states import RQ_STATUS, TERMINAL, State, sources

SUBMIT_TTL = 7 * 86400

# Job hash fields of a call submitted under an idempotency key: the key (TRANSITION gives it the record's
# TTL when the call ends) and the digest of what was asked (a resubmission asking otherwise is a conflict).
F_IDEM = "h_idem"
F_DIGEST = "h_digest"

# Reasons a transition script refused.
MISSING, FENCED, WRONG_STATE = -1, -2, -3


class Calls:
    """Scripted operations on call records."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._submit = conn.register_script(scripts.SUBMIT)
        self._transition = conn.register_script(scripts.TRANSITION)
        self._claim = conn.register_script(scripts.CLAIM)
        self._reap = conn.register_script(upkeep.REAP)
        self._spare_back = conn.register_script(upkeep.SPARE_BACK)
        self._requeue = conn.register_script(upkeep.REQUEUE)
        # Pub/sub is shared by every DB of a server: the scripts' wake-ups carry this DB's suffix.
        self.wake_suffix = keys.channel(conn, "")

    # -- submission ------------------------------------------------------------------------------

    def submit(
        self,
        env: Envelope,
        *,
        ckey: str,
        queue_size: int,
        max_attempts: int,
        timeout: float,
        concurrency: int = -1,
        pipeline: Pipeline | None = None,
    ) -> Any:
        """Admit a call with its ``pending`` event: onto its queue with a slot of ``ckey`` when one is free
        (``concurrency`` -1 = no limit), else waiting (at most ``queue_size``). Returns the script's reply."""
        info = CallInfo.of(env, ckey)
        ev = events.payload(
            call_id=env.call_id,
            state=State.PENDING,
            trace_id=info.trace_id,
            span_id=info.span_id,
            attempt=1,
            kind=env.kind,
            name=info.name,
            session_id=info.session_id,
            detail={"queue": env.queue},
        )
        fields = job_fields(env, ckey=ckey, max_attempts=max_attempts, timeout=timeout)
        flat = [x for k, v in fields.items() for x in (k, "" if v is None else v)]
        idem = env.options.idempotency_key
        digest = ""
        if idem:
            digest = request_digest(env)
            flat += [F_IDEM, keys.IDEMPOTENCY.format(idem), F_DIGEST, digest]
        return pipes.script(
            self._submit,
            [
                keys.job(env.call_id),
                keys.queue(env.queue),
                keys.history(env.call_id),
                keys.waiting(ckey),
                keys.RQ_QUEUES,
                keys.IDEMPOTENCY.format(idem or ""),
                keys.slots(ckey),
                keys.LIMITS,
                keys.spared(ckey),
            ],
            [
                env.call_id,
                ev,
                SUBMIT_TTL,
                queue_size,
                waiting_score(),
                env.channel,
                keys.queue(env.queue),
                digest,
                concurrency,
                ckey,
                self.wake_suffix,
                *flat,
            ],
            pipeline,
        )

    @staticmethod
    def check_submit(reply: Any, ckey: str, queue_size: int, env: Envelope | None = None) -> tuple[bool, str]:
        """Turn a SUBMIT reply into (accepted_new, call_id) or raise QueueFull / IdempotencyConflict.

        With ``env`` (the envelope submitted), an existing call of another tool or kind under the same
        idempotency key is a conflict too (a record of an older version carries no digest to compare).
        """
        code, value = int(reply[0]), reply[1]
        if code == -1:
            raise QueueFull(
                f"queue for {ckey!r} is full ({int(value)} waiting, limit {queue_size})",
                key=ckey,
                limit=queue_size,
                depth=int(value),
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

    # -- transitions -----------------------------------------------------------------------------

    def transition(
        self,
        info: CallInfo,
        target: State | None,
        *,
        attempt: int,
        detail: dict[str, Any] | None = None,
        fence: bool = True,
        from_states: frozenset[State] | None = None,
        lease: float | str | None = None,
        requeue: bool = False,
        requeue_score: float | None = None,
        schedule_at: float | None = None,
        fields: dict[str, Any] | None = None,
        ttl: int | None = None,
        event_type: str = events.TRANSITION,
        current: State | None = None,
        pipeline: Pipeline | None = None,
        handoff: tuple[str, float] | tuple[str, float, str, int] | None = None,
        via: Sequence[Step] = (),
        ts: float | None = None,
        unleased: bool = False,
    ) -> Any:
        """Move a call to ``target`` (or publish a non-state event when None), atomically with its event.

        ``via``: moves made before this one that were not written yet, ``(state, detail, ts)`` each in
        order, the first from ``current``; their events are recorded and published first, in the same
        script. ``ts``: when this move happened (default now). ``unleased``: only from ``pending`` while no
        worker holds the call (a caller cancelling it directly; a worker that took it is told instead).

        ``handoff`` (worker, lease seconds[, spare call id, spares wanted]): the released slot goes
        straight to that worker's spare, which it already runs, else to its oldest spare or the oldest
        waiting call of the same queue, leased to that worker (read it from the reply with ``handed_off``);
        the next oldest waiting calls of the queue, as many as wanted, are leased to the worker as spares,
        without a slot (``spared``).

        Ending (or ``retrying``) releases the call's concurrency slot and promotes the oldest waiting call
        of its key; ``requeue`` admits it again (a free slot, else waiting at ``requeue_score``, default
        now); ``schedule_at`` puts a ``retrying`` call on the scheduled set, due at that time.
        """
        release = target is not None and (target in TERMINAL or target is State.RETRYING)
        if via and target is None:
            raise ValueError("earlier moves ride only with a state change")
        early: list[bytes] = []
        first: frozenset[State] | None = None  # what the state in Redis must be: the first move's sources
        for state_, detail_, ts_ in via:  # each checked as if it were written alone
            first = self._check_move(current, state_, from_states if first is None else None, first)
            early.append(self._event(info, str(state_), attempt, events.TRANSITION, detail_, ts_))
            current = state_
        ho = handoff if handoff and release else None
        stamp = rq_now() if (target in TERMINAL or ho) else ""
        if target is not None:
            allowed = self._check_move(current, target, from_states if first is None else None, first)
            src = "pending!" if unleased else _joined(allowed)
            state = str(target)
            if target in TERMINAL:
                lease = "-"
                ttl = ttl or 86400
                fields = dict(fields or {})
                fields.setdefault("ended_at", stamp)
        else:
            src, state = "", ""
        ev = self._event(info, state or (str(current) if current else ""), attempt, event_type, detail, ts)
        flat: list[Any] = [len(early), *early]
        for k, v in (fields or {}).items():
            flat.append(k)
            flat.append(v)
        return pipes.script(
            self._transition,
            [
                keys.job(info.call_id),
                keys.history(info.call_id),
                keys.LEASES,
                keys.waiting(info.ckey),
                keys.slots(info.ckey),
                keys.LIMITS,
                keys.SCHEDULED,
                keys.spared(info.ckey),
            ],
            [
                info.call_id,
                ev,
                "" if ttl is None else ttl,
                str(attempt) if fence else "",
                src,
                state,
                RQ_STATUS[target] if target is not None else "",
                "" if lease is None else lease,
                keys.queue(info.queue) if requeue else "",
                waiting_score() if requeue_score is None else requeue_score,
                info.channel,
                "1" if release else "",
                info.ckey,
                "" if schedule_at is None else schedule_at,
                self.wake_suffix,
                ho[0] if ho else "",
                lease_deadline(ho[1]) if ho else "",
                stamp if ho else "",
                ho[2] if ho and len(ho) > 2 and ho[2] else "",
                int(ho[3]) if ho and len(ho) > 3 and ho[3] else "",
                *flat,
            ],
            pipeline,
        )

    @staticmethod
    def _check_move(
        current: State | None,
        target: State,
        from_states: frozenset[State] | None,
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
        info: CallInfo,
        state: str,
        attempt: int,
        event_type: str,
        detail: dict[str, Any] | None,
        ts: float | None,
    ) -> bytes:
        return events.payload(
            call_id=info.call_id,
            state=state,
            trace_id=info.trace_id,
            span_id=info.span_id,
            attempt=attempt,
            kind=info.kind,
            name=info.name,
            session_id=info.session_id,
            type=event_type,
            detail=detail,
            ts=ts,
        )

    @staticmethod
    def handed_off(reply: Any) -> Claimed | None:
        """The call a TRANSITION with ``handoff`` leased to the worker, if any."""
        if isinstance(reply, Exception) or len(reply) < 5 or not reply[2]:
            return None
        cid, data, attempt = reply[2], reply[3], reply[4]
        return Claimed(text(cid), data or b"", int(attempt or 1))

    @staticmethod
    def spared(reply: Any) -> list[tuple[Claimed, bytes]]:
        """The spares a TRANSITION that wanted some leased to the worker, oldest first, each with its
        waiting score."""
        if isinstance(reply, Exception) or len(reply) < 10:
            return []
        out = []
        for i in range(6, len(reply) - 3, 4):
            cid, data, attempt, score = reply[i], reply[i + 1], reply[i + 2], reply[i + 3]
            claimed = Claimed(text(cid), data or b"", int(attempt or 1))
            out.append((claimed, raw(score)))
        return out

    @staticmethod
    def spare_moved(reply: Any) -> bool:
        """Whether the spare a TRANSITION named took the slot its call released."""
        return not isinstance(reply, Exception) and len(reply) >= 6 and int(reply[5] or 0) == 1

    def load_scripts(self) -> None:
        """Load the scripts the hot paths queue into pipelines, so that none is refused (NOSCRIPT) and
        rerun after the commands queued behind it: writes of a worker depend on their order."""
        for script in (self._transition, self._spare_back, self._requeue, self._submit):
            self.conn.script_load(script.script)

    def spares_back(self, worker: str, call_ids: list[str], pipeline: Pipeline | None = None) -> list[str]:
        """Put spares back in line at their old places (``worker`` '' = whoever holds them); returns the
        ids left out because a cancel was asked for them, for the caller to end (with ``pipeline``: queued
        there, returns nothing)."""
        if not call_ids:
            return []
        args = [worker, self.wake_suffix, *call_ids]
        if pipeline is not None:
            pipes.script(self._spare_back, [keys.LEASES, keys.LIMITS], args, pipeline)
            return []
        reply = self._spare_back(keys=[keys.LEASES, keys.LIMITS], args=args)
        return [text(v) for v in reply]

    def requeue_unstarted(self, call_id: str, ckey: str, queue: str, pipeline: Pipeline | None = None) -> Any:
        """A call leased but never started, still ``pending`` and holding its slot: back at the head of its
        queue, unleased, keeping the slot (a no-op otherwise)."""
        return pipes.script(
            self._requeue,
            [keys.LEASES, keys.slots(ckey), keys.queue(queue)],
            [call_id, keys.wake(queue) + self.wake_suffix],
            pipeline,
        )

    # -- workers ---------------------------------------------------------------------------------

    def claim(self, queues: list[str], n: int, worker: str, lease: float) -> list[Claimed]:
        """Take up to ``n`` pending calls off the queues (in order), leased to ``worker``."""
        reply = self._claim(
            keys=[keys.LEASES, *(keys.queue(q) for q in queues)],
            args=[n, worker, lease_deadline(lease), rq_now()],
        )
        out = []
        for i in range(0, len(reply), 3):
            cid, data, attempt = reply[i], reply[i + 1], reply[i + 2]
            try:
                out.append(Claimed(cid.decode(), data or b"", int(attempt or 1)))
            except (TypeError, ValueError):  # one unreadable record is settled alone (broker.poison)
                poison.settle(self, cid, poison.row_problem({"h_attempt": attempt}))
        return out

    def extend_leases(
        self,
        call_ids: list[str],
        lease: float,
        pipeline: Pipeline | None = None,
        ckeys: dict[str, str] | None = None,
    ) -> None:
        """Push the lease deadline of calls still running here (only those still leased), and of the
        concurrency slots they hold (``ckeys``: call_id -> concurrency key)."""
        if not call_ids:
            return
        deadline = lease_deadline(lease)
        target = pipeline if pipeline is not None else self.conn
        target.zadd(keys.LEASES, {cid: deadline for cid in call_ids}, xx=True)
        by_key: dict[str, dict[str, int]] = {}
        for cid, ckey in (ckeys or {}).items():
            by_key.setdefault(ckey, {})[cid] = deadline
        for ckey, members in by_key.items():
            target.zadd(keys.slots(ckey), members, xx=True)

    def reap(self, lease: float, limit: int = 100) -> list[dict[str, Any]]:
        """Expired leases, taken over by this reaper for one more lease while it settles them."""
        now = time.time()
        reply = self._reap(keys=[keys.LEASES], args=[now, lease_deadline(lease), limit])
        out = []
        for i in range(0, len(reply), 8):
            cid, state, attempt, max_att, queue, cancel, ckey, spare = (text(v) for v in reply[i : i + 8])
            try:
                numbers = int(attempt or 1), int(max_att or 1)
            except ValueError:  # one unreadable record is settled alone (broker.poison)
                poison.settle(self, reply[i], poison.row_problem({"h_attempt": attempt, "h_max_attempts": max_att}))
                continue
            out.append(
                {
                    "call_id": cid,
                    "state": state,
                    "attempt": numbers[0],
                    "max_attempts": numbers[1],
                    "queue": queue,
                    "cancel": cancel == "1",
                    "ckey": ckey,
                    "spare": spare != "",
                }
            )
        return out

    # -- reading ---------------------------------------------------------------------------------

    def record(self, call_id: str) -> dict[str, Any] | None:
        """The call's record as plain values (state, attempt, result, error, ...)."""
        return read_record(self.conn, call_id)


@functools.lru_cache(maxsize=256)
def _joined(states: frozenset[State]) -> str:
    """The sources a script checks, as its ``a,b,c`` argument (a few distinct sets, each joined once)."""
    return ",".join(sorted(states))
