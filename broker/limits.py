"""Concurrency slots and scheduled retries, as seen from outside a call: sweep, due retries, snapshot.

The slots themselves are taken and given back inside the call scripts (SUBMIT, CLAIM, TRANSITION), so a
call's flow-control bookkeeping costs no extra round trip; this module holds what runs beside them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from . import keys, poison, upkeep


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


class Limits:
    """Scripted operations on concurrency slots and the retry schedule."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._sweep = conn.register_script(upkeep.SWEEP)
        self._due = conn.register_script(upkeep.DUE)
        self.wake_suffix = keys.channel(conn, "")

    def sweep(self, grace: float, per_key: int = 200) -> int:
        """Free slots whose lease ran out more than ``grace`` seconds ago and whose call no longer runs."""
        return int(self._sweep(keys=[keys.LIMITS], args=[time.time() - grace, per_key, self.wake_suffix]))

    def due(self, hold: float, limit: int = 100) -> tuple[list[Due], float | None]:
        """Retries due now (held ``hold`` seconds for this caller), and when the next one is due."""
        now = time.time()
        reply = self._due(keys=[keys.SCHEDULED], args=[now, now + hold, limit])
        nxt = reply[-1]
        out = []
        for i in range(0, len(reply) - 1, 10):
            cid, _state, attempt, trace, kind, tool, chan, ckey, origin, _queue = (
                v.decode() if isinstance(v, bytes) else str(v) for v in reply[i : i + 10]
            )
            try:
                out.append(Due(cid, int(attempt or 1), trace, kind, tool, chan, ckey, origin))
            except ValueError:  # an unreadable record: taken off the schedule, failed alone (broker.poison)
                from .calls import Calls

                self.conn.zrem(keys.SCHEDULED, cid)
                poison.settle(Calls(self.conn), cid, poison.row_problem({"h_attempt": attempt}))
        return out, (float(nxt) if nxt not in (b"", "", None) else None)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every concurrency key with its limit, calls holding a slot and calls waiting for one."""
        limits = {_text(k): int(v) for k, v in self.conn.hgetall(keys.LIMITS).items()}
        names = sorted(limits)
        pipe = self.conn.pipeline(transaction=False)
        for ckey in names:
            pipe.zcard(keys.slots(ckey))
            pipe.zcard(keys.waiting(ckey))
            pipe.zcard(keys.spared(ckey))  # waiting too: leased to a worker ahead of a free slot
        counts = pipe.execute()
        return [
            {
                "key": ckey,
                "limit": limits[ckey],
                "running": int(counts[3 * i]),
                "waiting": int(counts[3 * i + 1]) + int(counts[3 * i + 2]),
            }
            for i, ckey in enumerate(names)
        ]

    def scheduled(self) -> int:
        """How many retries are waiting for their time."""
        return int(self.conn.zcard(keys.SCHEDULED))


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
