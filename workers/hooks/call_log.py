"""A call's log lines: ``call started`` (DEBUG) and ``call finished`` (INFO; WARNING with the error when failed).

The ids (``call_id``, ``trace_id``, ``span_id``, ``tool``) are bound in contextvars by the runner. Only
the ``call finished`` line is written at the default level: each line costs a busy worker tens of µs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker import logs
from workers.hooks import Hook

if TYPE_CHECKING:
    from workers.runner import Running

# Ends that are not the call's end (it runs again, here or elsewhere): DEBUG, the next attempt logs its own.
NOT_ENDED = frozenset(("retrying", "handed_back", "lost"))


class CallLog(Hook):
    def before_call(self, run: Running) -> None:
        if logs.debug_enabled():
            logs.call_log().debug("call started", attempt=run.attempt, queue_wait_ms=round(run.queue_wait * 1000, 3))

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None:
        ms = round(duration * 1000, 3)
        if outcome == "failed":
            err = error or {}
            logs.call_log().warning(
                "call finished", state=outcome, duration_ms=ms, error_type=str(err.get("type") or "error"),
                error=err.get("message"),
            )
        elif outcome in NOT_ENDED:
            if logs.debug_enabled():
                logs.call_log().debug("call left this worker", state=outcome, duration_ms=ms)
        elif logs.info_enabled():
            logs.call_log().info("call finished", state=outcome, duration_ms=ms)
