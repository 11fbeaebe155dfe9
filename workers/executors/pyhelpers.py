"""Helper threads for ``python`` tools without ``ctx``, so a call can end at its deadline while the
function is abandoned and stopped with :class:`ToolStopped` (see :mod:`workers.executors.python`)."""

from __future__ import annotations

import _thread
import contextvars
import ctypes
import threading
from collections.abc import Callable
from typing import Any

import structlog

from broker.errors import ExecutorError

log = structlog.get_logger("hermes.executor.python")

DEFAULT_MAX_ABANDONED = 8
_HELPER_IDLE = 60.0  # seconds an idle helper thread waits for work before it ends
COOPERATION_GRACE = 1.0  # seconds an abandoned coroutine has to end on its loop's cancel before ToolStopped


class ToolStopped(BaseException):
    """Raised inside an abandoned python tool; a ``BaseException``, so ``except Exception`` misses it."""


# Called with the GIL held (pythonapi keeps it), so no Python code runs; NULL clears a pending exception.
_inject = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)
_uninject = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)

_QUEUED, _RUNNING, FINISHED = 0, 1, 2


class Job:
    """One function call on a helper thread. ``lock`` orders its start and end against ``stop``: a
    ToolStopped is injected only while the function runs, at most once, and cleared when it ends."""

    def __init__(self, call: Callable[[], Any], tally: Tally) -> None:
        self.call = call
        self.context = contextvars.copy_context()  # log fields and trace context follow the call
        self.tally = tally
        self.lock = _thread.allocate_lock()
        self.done = _thread.allocate_lock()
        self.done.acquire()  # released by the helper when the function has ended
        self.state = _QUEUED
        self.abandoned = False
        self.injected = False
        self.cooperative = False  # an async function's loop cancels its task itself: no ToolStopped
        self.ident = 0
        self.result: Any = None
        self.error: BaseException | None = None

    def begin(self, ident: int) -> bool:
        """On the helper: False when the call was given up before the function started."""
        with self.lock:
            if self.abandoned:
                return False
            self.ident = ident
            self.state = _RUNNING
            return True

    def execute(self) -> None:
        try:
            self.result = self.context.run(self.call)
        except BaseException as e:  # noqa: BLE001 - handed to the call thread as the call's outcome
            self.error = e

    def settle(self) -> None:
        """On the helper: the function has ended; no ToolStopped is pending after. Idempotent."""
        with self.lock:
            if self.injected:
                _uninject(self.ident, None)  # first: a pending ToolStopped must not fire later
            if self.state != FINISHED:
                self.state = FINISHED
                if self.abandoned:
                    self.tally.release()

    def stop(self) -> None:
        """On the call thread, once it gave up: abandon the function and ask it to stop."""
        with self.lock:
            self.abandoned = True
            if self.state == FINISHED:
                return
            self.tally.take()
            if self.state != _RUNNING:
                return
            if not self.cooperative:
                self.injected = True
                _inject(self.ident, ToolStopped)
                return
        # A coroutine's loop cancels it itself (a ToolStopped landing in the loop or in the coroutine's own
        # cleanup would cut that short); one that does not end by then (it runs sync code, or swallows the
        # cancel) gets the ToolStopped after COOPERATION_GRACE.
        timer = threading.Timer(COOPERATION_GRACE, self._stop_late)
        timer.daemon = True
        timer.start()

    def _stop_late(self) -> None:
        with self.lock:
            if self.state == _RUNNING and not self.injected:
                self.injected = True
                _inject(self.ident, ToolStopped)

    def cooperate(self) -> None:
        """On the helper: the function returned a coroutine, whose loop cancels it at the deadline or on
        cancel: ``stop`` leaves it COOPERATION_GRACE seconds for that before it injects."""
        with self.lock:
            self.cooperative = True


class Tally:
    """How many abandoned functions of one tool are still running in this process."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = _thread.allocate_lock()

    def take(self) -> None:
        with self.lock:
            self.count += 1

    def release(self) -> None:
        with self.lock:
            self.count -= 1


class _Helper:
    """A thread that runs one job at a time, handed to it by the pool."""

    def __init__(self, pool: HelperPool, number: int) -> None:
        self.pool = pool
        self.wake = _thread.allocate_lock()
        self.wake.acquire()
        self.job: Job | None = None
        self.thread = threading.Thread(target=self.loop, name=f"hermes-python-{number}", daemon=True)

    def loop(self) -> None:
        ident = threading.get_ident()
        while True:
            if not self.wake.acquire(timeout=_HELPER_IDLE):
                if self.pool.retire(self):
                    return
                self.wake.acquire()  # a job was handed to it just as it timed out
            job, self.job = self.job, None
            if job is None:  # the pool closed
                return
            self.serve(job, ident)
            # Back among the idle before the caller wakes: its next call reuses this thread.
            resting = self.pool.rest(self)
            job.done.release()
            if not resting:
                return

    @staticmethod
    def serve(job: Job, ident: int) -> None:
        # Until ``settle`` has cleared it, a ToolStopped may surface here too: catch it and go on.
        begun = False
        while True:
            try:
                if not begun:
                    begun = True
                    if job.begin(ident):
                        job.execute()
                job.settle()
                return
            except ToolStopped:
                continue


class HelperPool:
    """Helper threads for functions without ``ctx``: an idle one is reused, else a new one starts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[_Helper] = []  # a stack: the most recently used is reused, the others retire
        self.started = 0
        self.closed = False

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.closed:
                raise ExecutorError("the python executor is closed")
            if self.idle:
                helper = self.idle.pop()
            else:  # a new thread waits for ``wake`` like an idle one
                self.started += 1
                helper = _Helper(self, self.started)
                helper.thread.start()
            helper.job = job
        helper.wake.release()

    def rest(self, helper: _Helper) -> bool:
        with self.lock:
            if self.closed:
                return False
            self.idle.append(helper)
            return True

    def retire(self, helper: _Helper) -> bool:
        """An idle helper timed out: it ends unless a job was just handed to it."""
        with self.lock:
            if helper in self.idle:
                self.idle.remove(helper)
                return True
            return False

    def close(self) -> None:
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        for helper in idle:
            helper.wake.release()  # job None: it ends


