"""How many of a concurrency key's slots one worker process may keep: its fair share.

A call ending on a worker hands its slot straight to the next waiting call on that same worker (see
``Worker.reserve``), unless the worker already holds more than ``ceil(limit / live workers of the
queue)`` of the key's slots. Without that bound, whichever worker was first at the start would keep every
slot for good, its threads contending for one GIL while the other processes idle. The figures are read
by the heartbeat thread, never on a call's thread.
"""

from __future__ import annotations

import math
import threading
import time

import redis

from broker import keys
from broker.codec import text

FAIR_SHARE_TTL = 1.0  # seconds between re-reads of the limits and of the live workers sharing a queue


class FairShares:
    """The limits of every concurrency key and the live workers of each of our queues, as last read."""

    def __init__(
        self, conn: redis.Redis, queues: list[str], lease: float, refresh_now: threading.Event
    ) -> None:
        self.conn = conn
        self.queues = queues
        self.lease = lease
        self.refresh_now = refresh_now  # set: the heartbeat thread reads the figures at once
        self.limits: dict[str, int] = {}  # concurrency key -> its limit
        self.peers: dict[str, int] = {}  # our queue -> live workers serving it

    def fair_share(self, ckey: str, queue: str, floor: bool = False) -> float:
        """``ceil(limit / live workers on queue)`` for ``ckey`` (``floor``: rounded down) from the figures
        ``refresh`` keeps (no Redis round trip on the call's thread); unlimited or unknown: no bound."""
        limit = self.limits.get(ckey)
        if limit is None:  # a key first seen since the last read: the heartbeat thread reads it now
            self.limits[ckey] = -1  # (once: until then, and if it has no limit, no bound)
            self.refresh_now.set()
            return math.inf
        if limit <= 0:
            return math.inf
        share = limit / max(1, self.peers.get(queue, 1))
        return math.floor(share) if floor else math.ceil(share)

    def refresh(self) -> None:
        """Re-read the limits of every concurrency key and how many live workers serve each of our queues."""
        horizon = time.time() - max(15.0, self.lease)
        pipe = self.conn.pipeline(transaction=False)
        pipe.hgetall(keys.LIMITS)
        for q in self.queues:
            pipe.zcount(keys.queue_workers(q), horizon, "+inf")
        limits, *peers = pipe.execute()
        # Keys asked about but without an entry (no limit, or swept while idle) stay known as unlimited.
        self.limits = {
            **dict.fromkeys(self.limits, -1),
            **{text(k): int(text(v) or -1) for k, v in limits.items()},
        }
        self.peers = {q: int(n) for q, n in zip(self.queues, peers, strict=True)}
