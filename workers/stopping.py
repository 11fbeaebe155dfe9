"""How a worker process stops: a signal (or ``stop`` on the control channel) asks for it, the calls in
flight get the grace period, and what is left is handed back to its queue."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from broker.states import State
from workers.executors import close_all

if TYPE_CHECKING:
    from workers.runner import WorkerCore
    from workers.worker import CallThreads

log = structlog.get_logger("hermes.worker")
STUCK_WAIT = 2.0  # seconds past the grace for the call threads to return, the calls handed back already


def install_signals(request_stop: Callable[[], None]) -> None:
    """SIGTERM/SIGINT call ``request_stop``; a second SIGINT exits at once.

    The handler takes no lock (it may interrupt a thread holding one): it writes the signal number to a pipe,
    and a thread of ours logs it and asks the worker to stop.
    """
    read_fd, write_fd = os.pipe()
    interrupts = [0]

    def on_term(signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            interrupts[0] += 1
            if interrupts[0] > 1:
                os.write(2, b"second interrupt: stopping now\n")
                os._exit(1)
        try:
            os.write(write_fd, bytes([signum]))
        except OSError:
            pass  # the pipe is full of earlier signals: the stop is already on its way

    def relay() -> None:
        while True:
            try:
                signum = os.read(read_fd, 1)[0]
            except (OSError, IndexError):
                return
            log.info("stop requested", signal=signal.Signals(signum).name)
            request_stop()

    threading.Thread(target=relay, name="hermes-signals", daemon=True).start()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)


def drain(core: WorkerCore, pool: CallThreads, grace: float) -> int:
    """Wait up to ``grace`` seconds for the calls in flight, hand back the rest, and close the call threads
    and executors; the number of calls handed back."""
    deadline = time.monotonic() + grace
    core.flush(grace)  # calls handed to us in flight are submitted before the drain
    with core.idle:  # (untrack notifies it)
        core.idle.wait_for(lambda: not core.inflight_count(), deadline - time.monotonic())
    leftovers = core.inflight()
    for run in leftovers:
        hand_back(core, run)
    core.flush(grace)
    dropped = pool.shutdown(max(0.0, deadline - time.monotonic()) + STUCK_WAIT)
    if dropped:  # taken off the queue, never started: the reaper puts them back when their lease ends
        log.warning("calls taken but not started are left to the reaper", calls=dropped)
    core.close()
    close_all()
    return len(leftovers)


def hand_back(core: WorkerCore, run: Any) -> None:
    """Requeue a call the grace period could not finish; it does not count as a failed attempt. A call its
    caller cancelled (its tool did not stop in time) ends cancelled instead: handed back, it ran again."""
    from workers.reaper import end_call

    cancelled = core.is_cancelled(run.info.call_id)
    run.abandoned = True
    if run.ctx is not None:
        run.ctx.cancelled.set()
    current = run.state
    if current not in (State.ROUTING, State.EXECUTING, State.FORMATTING):
        return
    if cancelled:
        err = {"type": "cancelled", "message": "call cancelled; its worker stopped before the tool did"}
        end_call(core.calls, run.info, State.CANCELLED, current, run.attempt, err,
                 core.settings.workers.result_ttl, core.audit)  # fmt: skip
        return
    core.calls.hand_back(run.info, attempt=run.attempt, current=current, reason="worker_shutdown", free=True)
