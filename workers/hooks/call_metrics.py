"""Metrics of a call: queue wait and in-flight count when it begins, outcome and duration when it ends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers import metrics
from workers.hooks.hook import Hook

if TYPE_CHECKING:
    from workers.runner import Running


class CallMetrics(Hook):
    def before_call(self, run: Running) -> None:
        metrics.call_started(run.info.ckey, run.info.queue, run.queue_wait)

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None:
        info = run.info
        err_type = str(error.get("type") or "error") if error else None
        # An undecodable payload never started (claimed_at 0), so it was never counted in flight.
        metrics.call_ended(info.ckey, info.kind, info.name, outcome, err_type, duration, bool(run.claimed_at))
