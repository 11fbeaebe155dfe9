"""Concurrency slots and scheduled retries, as seen from outside a call: sweep, due retries, snapshot.

The slots themselves are taken and given back inside the call scripts (SUBMIT, CLAIM, TRANSITION).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from . import keys, pipes, poison, scripts
from .calls import Calls, recheck_absent
from .codec import text


@dataclass(frozen=True)
class Due:
    """A ``retrying`` call whose next attempt is due."""

    call_id: str
    attempt: int
    trace_id: str
    kind: str
    name: str
    channel: str
    ckey: str
    queue: str
    session_id: str | None = None


class Limits:
    """Scripted operations on concurrency slots and the retry schedule."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._sweep = conn.register_script(scripts.SWEEP)
        self._due = conn.register_script(scripts.TAKE_DUE)

    def sweep(self, queues: Sequence[str], grace: float, per_key: int = 200) -> int:
        """Free slots of calls on ``queues`` whose lease ran out more than ``grace`` seconds ago and whose
        call no longer runs (one script per concurrency key: each touches one queue's slot)."""
        freed = 0
        for q in queues:
            tag = keys.tag(q)
            wake = keys.channel(self.conn, keys.wake(keys.base_queue(q)))
            try:
                for ckey in map(text, self.conn.hkeys(keys.limits(tag))):
                    freed += int(
                        self._sweep(
                            keys=[
                                keys.slots(tag, ckey),
                                keys.waiting(tag, ckey),
                                keys.limits(tag),
                                keys.queue(q),
                                keys.waiting_batch(tag, ckey),
                                keys.fair(tag, ckey),
                                keys.rate(tag, ckey),
                                keys.rate_log(tag, ckey),
                                keys.rate_due(tag),
                            ],
                            args=[time.time() - grace, per_key, ckey, keys.job(""), wake],
                        )
                    )
            except redis.RedisError as e:
                if not pipes.moving(e):
                    raise  # (a queue whose slot is moving to another node is swept next time)
        return freed

    def due(self, queues: Sequence[str], hold: float, limit: int = 100) -> tuple[list[Due], float | None]:
        """Retries on ``queues`` due now (held ``hold`` seconds for this caller), and when the next is due."""
        now = time.time()
        out = []
        nxt: float | None = None
        for q in queues:
            scheduled = keys.scheduled(keys.tag(q))
            try:
                reply = self._due(keys=[scheduled], args=[now, now + hold, limit, keys.job(""), "due"])
            except redis.RedisError as e:
                if not pipes.moving(e):
                    raise
                continue  # this queue's slot is moving to another node: its retries are taken next time
            recheck_absent(self.conn, reply.pop(), zset=scheduled)  # (a record mid-migration keeps its retry)
            after = reply[-1]
            for i in range(0, len(reply) - 1, 11):
                cid, _state, attempt, trace, kind, tool, chan, ckey, origin, _queue, session = (
                    v.decode() if isinstance(v, bytes) else str(v) for v in reply[i : i + 11]
                )
                try:
                    out.append(Due(cid, int(attempt or 1), trace, kind, tool, chan, ckey, origin or q, session or None))
                except ValueError:  # an unreadable record: taken off the schedule, failed alone (broker.poison)
                    self.conn.zrem(scheduled, cid)
                    poison.settle(Calls(self.conn), cid, poison.row_problem({"h_attempt": attempt}))
            if after not in (b"", "", None):
                nxt = float(after) if nxt is None else min(nxt, float(after))
        return out, nxt

    def queues(self) -> list[str]:
        """Every queue RQ's set lists (the queues calls were submitted to)."""
        return sorted(keys.queue_name(text(k)) for k in self.conn.smembers(keys.RQ_QUEUES))

    def snapshot(self) -> list[dict[str, Any]]:
        """Every concurrency key with its limit, calls holding a slot and calls waiting for one (both
        classes), summed over its queues; a partitioned tool's limit is the sum of its partitions' shares."""
        per: dict[str, dict[str, int]] = {}
        shares: dict[str, dict[str, int]] = {}  # concurrency key -> logical queue -> its limit (summed)
        for q in self.queues():
            tag = keys.tag(q)
            limits = {text(k): int(v) for k, v in self.conn.hgetall(keys.limits(tag)).items()}
            names = sorted(limits)
            pipe = self.conn.pipeline(transaction=False)
            for ckey in names:
                pipe.zcard(keys.slots(tag, ckey))
                pipe.zcard(keys.waiting(tag, ckey))
                pipe.zcard(keys.waiting_batch(tag, ckey))
            counts = pipe.execute() if names else []
            for i, ckey in enumerate(names):
                row = per.setdefault(ckey, {"limit": limits[ckey], "running": 0, "waiting": 0})
                row["running"] += int(counts[3 * i])
                row["waiting"] += int(counts[3 * i + 1]) + int(counts[3 * i + 2])
                by_queue = shares.setdefault(ckey, {})
                base, share = keys.base_queue(q), limits[ckey]
                had = by_queue.get(base)
                by_queue[base] = share if had is None else -1 if had < 0 or share < 0 else had + share
        for ckey, by_queue in shares.items():
            per[ckey]["limit"] = max(by_queue.values())
        return [{"key": ckey, **per[ckey]} for ckey in sorted(per)]

    def scheduled(self) -> int:
        """How many retries are waiting for their time."""
        return sum(int(self.conn.zcard(keys.scheduled(keys.tag(q)))) for q in self.queues())
