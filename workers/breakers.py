"""The worker's side of circuit breakers: which breaker guards a tool, and one call's pass through it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import structlog

from broker.breaker import BreakerConfig, Breakers, Change
from broker.errors import CallCancelled, CircuitOpen, HermesError
from broker.events import PROGRESS
from broker.toolspec import ToolSpec
from workers import metrics

if TYPE_CHECKING:
    from workers.core import WorkerCore
    from workers.runner import Running

log = structlog.get_logger("hermes.breaker")

Publish = Callable[["Running", str, dict[str, Any]], None]


def breaker_config(settings: Any, spec: ToolSpec) -> BreakerConfig | None:
    """The tool's ``breaker:`` over ``executors.<type>.breaker``; None when neither asks for one."""
    base = settings.executor_settings(spec.executor).get("breaker")
    base = base if isinstance(base, dict) else None
    if not spec.breaker and base is None:
        return None
    return BreakerConfig.of({**(base or {}), **(spec.breaker or {})}, f"tool:{spec.name}")


class BreakerGuard:
    """Checks a tool's breaker before its executor runs and counts the outcome after."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self.breakers = Breakers(core.conn)

    @contextmanager
    def guard(self, run: Running, spec: ToolSpec, timeout: float, publish: Publish | None) -> Iterator[None]:
        """Around the executor: CircuitOpen at once while open; the outcome counted (or not) after."""
        cfg = breaker_config(self.core.settings, spec)
        if cfg is None:
            yield
            return
        call_id = run.info.call_id
        decision = self.breakers.check(cfg, call_id, probe_ttl=timeout + self.core.settings.workers.lease)
        if decision.change is not None:
            self._announce(run, decision.change, publish)
        if not decision.allowed:
            raise CircuitOpen(
                f"circuit breaker {cfg.key!r} is open; the back end was not called",
                key=cfg.key,
                retry_at=decision.retry_at,
            )
        outcome, etype = "ok", ""
        try:
            yield
        except CallCancelled:
            outcome = "neutral"
            raise
        except HermesError as e:
            etype = e.type
            outcome = "fail" if cfg.counts(etype) else "neutral"
            raise
        except Exception:
            etype = "internal_error"
            outcome = "fail" if cfg.counts(etype) else "neutral"
            raise
        finally:
            # Only the probe needs to report a neutral outcome (it frees the half-open slot).
            if outcome != "neutral" or decision.probe:
                try:
                    change = self.breakers.record(cfg, call_id, outcome, etype)
                except Exception:  # noqa: BLE001 - a breaker write must not change the call's outcome
                    log.exception("breaker outcome not recorded", key=cfg.key)
                    change = None
                if change is not None:
                    self._announce(run, change, publish)

    def _announce(self, run: Running, change: Change, publish: Publish | None) -> None:
        log.warning("circuit breaker changed", key=change.key, state=change.state, reason=change.reason)
        metrics.breaker_changed(change.key, change.previous, change.state)
        breakers = self.breakers
        self.core.outbox.put(lambda pipe: breakers.publish(change, pipe))
        if publish is not None:
            message = f"circuit breaker {change.key!r}: {change.previous} -> {change.state}"
            if change.reason:
                message += f" ({change.reason})"
            publish(run, PROGRESS, {"message": message, "breaker": change.to_dict()})
