"""The workers' side of call records: claim, leases, reaping, a claimed call put back unstarted.

Each is one script on one queue's slot (``broker/lua/claim.lua``, ``take_due.lua``, ``requeue.lua``);
``broker.calls.Calls`` adds submission and transitions on top.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis
import structlog
from redis.client import Pipeline

from . import keys, partitions, pipes, poison, scripts
from .codec import raw, text
from .connection import is_cluster
from .records import CallInfo, Claimed, lease_deadline, rq_now

log = structlog.get_logger("hermes.claims")
_ABSENT_PATIENCE = 30.0  # seconds a recheck waits out a moving slot (a migration of one slot)


class Claims:
    """Scripted operations of the workers on call records."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._claim = conn.register_script(scripts.CLAIM)
        self._reap = conn.register_script(scripts.TAKE_DUE)
        self._requeue = conn.register_script(scripts.REQUEUE)
        self._strict_ids = is_cluster(conn)  # (see claim.lua: ids of another slot are not looked up)

    def wake_channel(self, queue: str) -> str:
        """The wake-up channel of ``queue`` (pub/sub is shared by every DB of a server: scoped to ours)."""
        return keys.channel(self.conn, keys.wake(partitions.base(queue)))

    def requeue_unstarted(self, call_id: str, ckey: str, queue: str, pipeline: Pipeline | None = None) -> Any:
        """A call leased but never started, still ``pending`` and holding its slot: back at the head of its
        queue, unleased, keeping the slot (a no-op otherwise)."""
        tag = keys.tag(queue)
        return pipes.script(
            self._requeue,
            [keys.leases(tag), keys.slots(tag, ckey), keys.queue(queue), keys.job(call_id)],
            [call_id, self.wake_channel(queue)],
            pipeline,
        )

    # -- workers ---------------------------------------------------------------------------------

    def claim(self, queues: list[str], n: int, worker: str, lease: float) -> list[Claimed]:
        """Take up to ``n`` pending calls off the queues (in order), leased to ``worker``: one script per
        queue (each queue is a slot of its own), the next queue only while fewer than ``n`` came. A queue
        whose slot is moving to another node (a cluster's redirections, ``pipes.moving``) is skipped this
        time."""
        out: list[Claimed] = []
        deadline, now = lease_deadline(lease), rq_now()
        for q in queues:
            tag = keys.tag(q)
            try:
                reply, absent = self._claim(
                    keys=[keys.leases(tag), keys.queue(q)],
                    args=[n - len(out), worker, deadline, now, keys.job(""), keys.slots(tag, ""), tag + "." if self._strict_ids else ""],
                )
            except redis.RedisError as e:
                if not pipes.moving(e):
                    raise
                continue  # this queue's slot is moving to another node: claimed again once it is there
            if absent:
                for gone in self.recheck_absent(absent, requeue=keys.queue(q)):
                    DROPPED.warn(q, gone)
            for i in range(0, len(reply), 3):
                cid, data, attempt = reply[i], reply[i + 1], reply[i + 2]
                try:
                    out.append(Claimed(cid.decode(), data or b"", int(attempt or 1)))
                except (TypeError, ValueError):  # one unreadable record is settled alone (broker.poison)
                    poison.settle(self, cid, poison.row_problem({"h_attempt": attempt}))  # type: ignore[arg-type]
            if len(out) >= n:
                break
        return out

    def recheck_absent(self, ids: list[bytes], *, requeue: str | None = None, zset: str | None = None) -> list[bytes]:
        return recheck_absent(self.conn, ids, requeue=requeue, zset=zset)

    def extend_leases(self, runs: Sequence[CallInfo], lease: float, pipeline: Pipeline | None = None) -> None:
        """Push the lease deadline of calls still running here (only those still leased), and of the
        concurrency slots they hold."""
        if not runs:
            return
        deadline = lease_deadline(lease)
        target = pipeline if pipeline is not None else self.conn
        by_lease: dict[str, dict[str, int]] = {}
        by_slots: dict[str, dict[str, int]] = {}
        for info in runs:
            tag = keys.tag(info.queue)
            by_lease.setdefault(keys.leases(tag), {})[info.call_id] = deadline
            by_slots.setdefault(keys.slots(tag, info.ckey), {})[info.call_id] = deadline
        for key, members in (*by_lease.items(), *by_slots.items()):
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
            self.recheck_absent(reply.pop(), zset=keys.leases(keys.tag(q)))
            for i in range(0, len(reply), 7):
                cid, state, attempt, max_att, queue, cancel, ckey = (text(v) for v in reply[i : i + 7])
                try:
                    numbers = int(attempt or 1), int(max_att or 1)
                except ValueError:  # one unreadable record is settled alone (broker.poison)
                    problem = poison.row_problem({"h_attempt": attempt, "h_max_attempts": max_att})
                    poison.settle(self, reply[i], problem)  # type: ignore[arg-type]
                    continue
                out.append(
                    {
                        "call_id": cid,
                        "state": state,
                        "attempt": numbers[0],
                        "max_attempts": numbers[1],
                        # (a record without h_queue: the id's tag is its queue's, so its lease can go)
                        "queue": queue or keys.RQ_QUEUE.format(keys.tag_in(cid) or keys.tag(q)),
                        "cancel": cancel == "1",
                        "ckey": ckey,
                    }
                )
        return out


def recheck_absent(conn: Any, ids: list[bytes], *, requeue: str | None = None, zset: str | None = None) -> list[bytes]:
    """Ids a script found no record of, asked again where a cluster's redirections are followed: a
    record on its way to another node (a slot migration) keeps its place — back at the head of
    ``requeue`` (it still holds its slot), or left in ``zset`` (held) — and one that is gone (expired)
    leaves ``zset``. An id without the tag of ``requeue``'s queue is no call of it, never looked up.
    Returns the ids dropped."""
    prefix = keys.tag_in(requeue).encode() + b"." if requeue is not None else b""
    gone = []
    for raw_id in ids:
        cid = text(raw_id)
        # A slot mid-migration bounces single-key commands too (MOVED back and forth while its nodes learn
        # the new owner): asked again, so a popped id is never dropped.
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
    """One warning for each id drained off a queue that names no call there (raw bytes, a foreign tag, a
    record that does not exist), at most ``burst`` a minute per process; the rest are counted into the
    next warning."""

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
            "dropped an id on queue that names no call of it",
            queue=queue,
            call_id=shown[:40] + ("..." if len(shown) > 40 else ""),
            **({"suppressed_before": more} if more else {}),
        )


DROPPED = DroppedIds()
