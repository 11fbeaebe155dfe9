"""The threads a worker process runs calls on.

What ``ThreadPoolExecutor`` does for this case — up to ``size`` threads taking work off one queue, a new
thread only when none is idle — without what a call here does not use: a ``Future`` (two condition
variables), a work item and an executor-wide lock per call. A worker hands every call to a thread, so
under load that was a measurable share of its CPU. ``workers.shortcuts_off: [threads]`` runs calls on a
``ThreadPoolExecutor`` instead (``StockThreads``; bench/shortcuts.py measures both).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from broker import shortcuts

log = structlog.get_logger("hermes.worker")

_STOP = object()


class CallThreads:
    """Runs ``fn(arg)`` on up to ``size`` threads named ``<prefix>_<n>``."""

    def __init__(self, size: int, prefix: str) -> None:
        self.size = max(1, size)
        self.prefix = prefix
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads that finished a task and will take the next one (as the executor counts)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Queue ``fn(arg)``; RuntimeError once shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot run new calls after shutdown")
            self._queue.put((fn, arg))
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < self.size:
                t = threading.Thread(target=self._loop, name=f"{self.prefix}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()

    def _loop(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is _STOP:
                return
            fn, arg = item
            try:
                fn(arg)
            except BaseException:  # noqa: BLE001 - a task's failure must not take the thread with it
                log.exception("call thread task failed")
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, cancel_pending: bool = True) -> int:
        """Take no more work; drop what has not started (``cancel_pending``); returns how many were dropped."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        dropped = 0
        if cancel_pending:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    dropped += 1
        for _ in threads:
            self._queue.put(_STOP)
        if wait:
            for t in threads:
                t.join()
        return dropped


class StockThreads(CallThreads):
    """The same interface on the standard library's ``ThreadPoolExecutor`` (the ``threads`` shortcut off)."""

    def __init__(self, size: int, prefix: str) -> None:
        super().__init__(size, prefix)
        self._executor = ThreadPoolExecutor(self.size, thread_name_prefix=prefix)
        self._pending: set[Future[None]] = set()

    def submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot run new calls after shutdown")
            future = self._executor.submit(self._run, fn, arg)
            self._pending.add(future)
        future.add_done_callback(self._forget)

    @staticmethod
    def _run(fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except BaseException:  # noqa: BLE001 - as CallThreads: a task's failure is logged, not raised
            log.exception("call thread task failed")

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)

    def shutdown(self, wait: bool = True, cancel_pending: bool = True) -> int:
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        dropped = sum(1 for f in pending if f.cancel()) if cancel_pending else 0
        self._executor.shutdown(wait=wait)
        return dropped


def call_threads(size: int, prefix: str) -> CallThreads:
    """The call threads of a worker: ``CallThreads``, or ``StockThreads`` with the shortcut off."""
    return CallThreads(size, prefix) if shortcuts.on("threads") else StockThreads(size, prefix)


class Tokens:
    """A counting semaphore that hands out several tokens at once: the dispatcher takes what is free in one
    step instead of one ``acquire`` per token (it claims up to a batch of calls at a time)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._cv = threading.Condition(threading.Lock())

    @property
    def free(self) -> int:
        return self._n

    def take(self, most: int, timeout: float | None = None) -> int:
        """Up to ``most`` tokens, waiting up to ``timeout`` for the first; 0 when none came."""
        with self._cv:
            if self._n <= 0 and not self._cv.wait_for(lambda: self._n > 0, timeout):
                return 0
            k = min(most, self._n)
            self._n -= k
            return k

    def give(self, k: int = 1) -> None:
        with self._cv:
            self._n += k
            self._cv.notify()
