"""Write-behind: many threads queue Redis writes, one thread sends them in pipelines (in order: one queue,
one sender)."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import redis
import structlog
from redis.client import Pipeline

from broker import keys, pipes
from broker.durability import Confirmer

log = structlog.get_logger("hermes.worker.outbox")

Writer = Callable[[Pipeline], Any]
Callback = Callable[[Any], None]

_CLOSING_TRIES = 5  # a closing outbox (worker shutdown) stops retrying an unreachable broker after these
_STOP = object()  # close()'s mark on the queue: the sender sends what came before it, then ends


class Outbox:
    """A FIFO of pipeline writers flushed by one background thread."""

    def __init__(
        self, conn: redis.Redis, max_batch: int = 512, confirmer: Confirmer | None = None, name: str = "hermes-outbox"
    ) -> None:
        self.conn = conn
        # With ``broker.wait_replicas``, each batch ends with WAIT: its callbacks wait for the replicas.
        self.confirmer = confirmer if confirmer is not None and confirmer.asked else None
        self._unconfirmed_logged = 0.0
        self.max_batch = max_batch
        # (a SimpleQueue's put and get are C calls: a Condition's notify and wait are Python, per write)
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()  # set by close(): ends a retry's backoff at once
        self._connection: Any = None  # the sender's own connection, taken from the pool once
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, writer: Writer, callback: Callback | None = None) -> None:
        """Queue a write; ``callback`` gets the reply of the first command ``writer(pipe)`` adds."""
        self._items.put((writer, callback))

    def call(self, writer: Writer, timeout: float = 30.0) -> Any:
        """Queue a write and wait for its reply."""
        answered: Future[Any] = Future()
        self.put(writer, answered.set_result)
        try:
            reply = answered.result(timeout)
        except TimeoutError:
            raise TimeoutError("outbox write not flushed in time") from None
        if isinstance(reply, Exception):
            raise reply
        return reply

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far has been sent."""
        try:
            self.call(lambda pipe: pipe.exists(keys.WORKERS), timeout)  # (a keyed no-op: a cluster pipeline takes no ECHO)
            return True
        except (TimeoutError, redis.RedisError):
            return False

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued (waiting up to ``timeout`` for it), then stop: an unreachable broker gets its
        last few tries at once, not after a backoff, and writes still unsent then fail."""
        self.flush(timeout)
        self._closed.set()
        self._items.put(_STOP)
        self._thread.join(timeout)
        if self._connection is not None and not self._thread.is_alive():
            self.conn.connection_pool.release(self._connection)
            self._connection = None

    def _run(self) -> None:
        items = self._items
        while True:
            batch = [items.get()]
            for _ in range(min(items.qsize(), self.max_batch - 1)):  # (this thread alone takes: they are there)
                batch.append(items.get_nowait())
            stop = _STOP in batch
            batch = [item for item in batch if item is not _STOP] if stop else batch
            if batch:
                self._send(batch)
            if stop:
                return

    def _send(self, batch: list[tuple[Writer, Callback | None]]) -> None:
        answered = [False] * len(batch)

        def answer(k: int, reply: Any) -> None:
            if answered[k]:  # (answered early, in a round a dropped connection then sent again)
                return
            answered[k] = True
            cb = batch[k][1]
            if cb is not None:
                try:
                    cb(reply)
                except Exception:  # noqa: BLE001 - a callback must not stop the sender
                    log.exception("outbox callback failed")

        try:
            replies = self._execute(batch, answer)
        except Exception as e:  # noqa: BLE001 - the sender thread must survive anything
            log.exception("outbox batch failed")
            replies = [e] * len(batch)
        for k, reply in enumerate(replies):
            answer(k, reply)

    @staticmethod
    def _settled(starts: list[int], ends: list[int], early: Callable[[int, Any], None]) -> pipes.Settled:
        """``pipes.stock``'s ``on_settled``: answer the writers whose commands (``starts[k]`` to ``ends[k]``)
        all ran."""

        def settled(replies: list[Any], refused: set[int]) -> None:
            for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
                if not refused.intersection(range(start, end)):
                    early(k, replies[start] if start < end else None)

        return settled

    def _confirmed(self, acked: Any, writes: int) -> None:
        assert self.confirmer is not None
        short = self.confirmer.check(acked, "worker writes")
        if short is not None and time.monotonic() >= self._unconfirmed_logged + 10:
            self._unconfirmed_logged = time.monotonic()
            log.warning("writes not confirmed by the replicas", writes=writes, why=str(short))

    def _keep_trying(self, rounds: int, error: Exception) -> bool:
        """Whether to send again the writes a moving cluster slot refused: while the migration lasts (their
        calls keep their leases meanwhile, ``WorkerCore.unwritten``), only a few more times once closing."""
        if rounds == 0 or rounds % 60 == 0:  # (about every 30 s while it lasts)
            log.warning("a cluster slot is moving: writes wait for it", error=str(error), rounds=rounds)
        return not self._closed.is_set() or rounds < _CLOSING_TRIES * 4

    def _execute(
        self, batch: list[tuple[Writer, Callback | None]], early: Callable[[int, Any], None] | None = None
    ) -> list[Any]:
        """Send one pipeline; each writer's reply is the reply of the first command it added.

        While the broker is unreachable the batch is sent again until it answers (a call that finished during
        an outage keeps its result; the writes are fenced by attempt); only a closing outbox gives up. On a
        cluster, the writes a moving slot refuses are sent again alone (``_keep_trying``); ``early(k, reply)``
        meanwhile answers each writer none of whose commands was refused (not with WAIT).
        """
        for attempt in itertools.count():
            if attempt >= _CLOSING_TRIES and self._closed.is_set():
                break
            pipe = self.conn.pipeline(transaction=False)
            starts: list[int] = []
            unbuilt: dict[int, Exception] = {}  # writers that raised: they fail alone, the batch goes on
            for k, (writer, _) in enumerate(batch):
                starts.append(len(pipe))
                try:
                    writer(pipe)
                except Exception as e:  # noqa: BLE001 - e.g. a value the wire cannot carry, in one call's write
                    del pipe.command_stack[starts[-1] :]  # (what it had added: none of it is sent)
                    unbuilt[k] = e
                    log.error("a write could not be built; it alone fails", error=f"{type(e).__name__}: {e}")
            ends = [*starts[1:], len(pipe)]  # (WAIT comes after them)
            if early is not None:
                for k, error in unbuilt.items():
                    early(k, error)  # (answered now: it has no command, so nothing else answers it)
            confirm = self.confirmer is not None and self.confirmer.queue(pipe)
            settled = None if confirm or early is None else self._settled(starts, ends, early)
            try:
                if self._connection is None and hasattr(self.conn, "connection_pool"):  # (none on a cluster)
                    self._connection = self.conn.connection_pool.get_connection()
                replies = pipes.execute(pipe, self._connection, self._keep_trying, settled)
                if confirm:
                    self._confirmed(replies[-1], len(batch))
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if attempt < 5 or attempt % 30 == 0:  # not a line every 2 s for a long outage
                    log.warning(
                        "outbox flush failed, retrying", error=str(e), attempt=attempt + 1, writes=len(batch)
                    )
                self._closed.wait(min(0.1 * 2 ** min(attempt, 5), 2.0))
                continue
            return [
                unbuilt[k] if k in unbuilt else replies[s] if s < e else None  # (no command: None)
                for k, (s, e) in enumerate(zip(starts, ends, strict=True))
            ]
        return [redis.ConnectionError("broker unreachable")] * len(batch)
