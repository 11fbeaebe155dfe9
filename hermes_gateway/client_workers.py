"""Which workers listen on a queue, for ``Gateway``: a call to a queue nobody serves is refused at once
(``NoWorkers``) — or, on an embedded broker of the gateway's own, a worker is started for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from broker import keys
from broker.codec import text
from broker.errors import NoWorkers

if TYPE_CHECKING:
    import redis

    from broker.config import Settings
    from broker.connection import BrokerHandle

WORKERS_TRUSTED = 5.0  # seconds a queue seen with a live worker is not checked again (check_workers)


class ClientWorkers:
    """The part of ``hermes_gateway.client.Gateway`` that asks about workers (it provides these attributes)."""

    conn: redis.Redis
    settings: Settings
    broker: BrokerHandle
    check_workers: bool
    _workers_seen: dict[str, float]
    _own_workers: list[Any]
    _workers_lock: threading.Lock

    def live_workers(self, queue: str | None = None, within: float | None = None) -> list[dict[str, Any]]:
        """Workers whose heartbeat is recent, optionally only those listening on ``queue``."""
        horizon = time.time() - (within or max(15.0, self.settings.workers.lease))
        names = self.conn.zrangebyscore(keys.WORKERS, horizon, "+inf")
        pipe = self.conn.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.worker(text(n)))
        out = []
        for raw in pipe.execute():
            if not raw:
                continue
            w = {k.decode(): v.decode() for k, v in raw.items()}
            if queue is None or queue in w.get("queues", "").split(","):
                out.append(w)
        return out

    def require_workers(self, queue: str) -> None:
        if not self.live_workers(queue):
            raise NoWorkers(
                f"no worker listens on queue {queue!r} at {self.broker.description}; start one with "
                f"`hermes-gateway worker --queues {queue}`",
                queue=queue,
            )

    def _unchecked(self, queues: Iterable[str]) -> bool:
        """Whether ``_ensure_workers(queues)`` has anything to ask the broker (no I/O: the async client
        runs the check in a thread only then)."""
        now = time.monotonic()
        return self.check_workers and any(self._workers_seen.get(q, 0.0) <= now for q in queues)

    def _ensure_workers(self, queues: tuple[str, ...]) -> None:
        """With ``check_workers``: NoWorkers for a queue no worker listens on — or, on an embedded broker
        of our own, a worker started for it. A queue seen served is trusted for a few seconds."""
        if not self.check_workers:
            return
        for queue in queues:
            if self._workers_seen.get(queue, 0.0) > time.monotonic():
                continue
            with self._workers_lock:
                if not self.live_workers(queue):
                    if self.broker.embedded is None:
                        self.require_workers(queue)  # raises
                    from hermes_gateway.local import start_workers, wait_for_heartbeats

                    self._own_workers += start_workers(self.broker.url, self.settings, (queue,))
                    wait_for_heartbeats(self, 1, queues=(queue,))  # type: ignore[arg-type]
                self._workers_seen[queue] = time.monotonic() + WORKERS_TRUSTED


class WorkerCheck(ClientWorkers):
    """The worker check on its own, over a broker's sync connection: ``AsyncGateway`` runs it (in a thread)
    exactly as ``Gateway`` does, and stops the workers it started with ``close()``."""

    def __init__(self, broker: BrokerHandle, settings: Settings, check_workers: bool) -> None:
        self.broker = broker
        self.conn = broker.conn
        self.settings = settings
        self.check_workers = check_workers
        self._workers_seen = {}
        self._own_workers = []
        self._workers_lock = threading.Lock()

    def close(self) -> None:
        if self._own_workers:
            from workers.pool import stop_all

            stop_all(self._own_workers)
            self._own_workers = []
