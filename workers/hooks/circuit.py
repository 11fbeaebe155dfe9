"""A tool's circuit breaker (``broker/breaker.py``): checked right before its executor (open: CircuitOpen,
the back end is not called) and told the executor's outcome after. A state change is logged, counted,
published to the fleet and told to the call's caller as a ``progress`` event."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import structlog

from broker.breaker import BreakerConfig, Breakers, Change, breaker_config
from broker.errors import CallCancelled, CircuitOpen, HermesError
from broker.events import PROGRESS
from workers import metrics
from workers.hooks import Hook

if TYPE_CHECKING:
    from broker.toolspec import ToolSpec
    from workers.runner import Running, WorkerCore

log = structlog.get_logger("hermes.breaker")


class Circuit(Hook):
    def __init__(self, core: WorkerCore) -> None:
        super().__init__(core)
        # Each spec's breaker config, made once: the directory hands out the same spec object until the
        # tool's version changes, and a worker's settings do not change (id -> (spec, config)).
        self._configs: dict[int, tuple[ToolSpec, BreakerConfig | None]] = {}

    def config(self, spec: ToolSpec) -> BreakerConfig | None:
        known = self._configs.get(id(spec))
        if known is not None and known[0] is spec:
            return known[1]
        if len(self._configs) > 4096:  # (specs of replaced versions)
            self._configs.clear()
        cfg = breaker_config(self.core.settings, spec)
        self._configs[id(spec)] = (spec, cfg)
        return cfg

    @functools.cached_property
    def breakers(self) -> Breakers:
        return Breakers(self.core.conn)

    def before_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        cfg = self.config(spec)
        if cfg is None:
            return
        probe_ttl = (run.ctx.timeout if run.ctx is not None else 0.0) + self.core.settings.workers.lease
        decision = self.breakers.check(cfg, run.info.call_id, probe_ttl=probe_ttl)
        if decision.change is not None:
            self._announce(run, decision.change)
        if not decision.allowed:
            raise CircuitOpen(
                f"circuit breaker {cfg.key!r} is open; the back end was not called",
                key=cfg.key,
                retry_at=decision.retry_at,
            )
        run.breaker = (cfg, decision.probe)

    def after_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        if run.breaker is None:
            return
        (cfg, probe), run.breaker = run.breaker, None
        outcome, etype = "ok", ""
        if isinstance(error, CallCancelled):
            outcome = "neutral"
        elif error is not None:
            etype = error.type if isinstance(error, HermesError) else "internal_error"
            outcome = "fail" if cfg.counts(etype) else "neutral"
        if outcome == "neutral" and not probe:  # only the probe reports a neutral outcome (it frees the slot)
            return
        try:
            change = self.breakers.record(cfg, run.info.call_id, outcome, etype)
        except Exception:  # noqa: BLE001 - a breaker write must not change the call's outcome
            log.exception("breaker outcome not recorded", key=cfg.key)
            return
        if change is not None:
            self._announce(run, change)

    def _announce(self, run: Running, change: Change) -> None:
        log.warning("circuit breaker changed", key=change.key, state=change.state, reason=change.reason)
        metrics.breaker_changed(change.key, change.previous, change.state)
        breakers = self.breakers
        self.core.outbox.put(lambda pipe: breakers.publish(change, pipe))
        message = f"circuit breaker {change.key!r}: {change.previous} -> {change.state}"
        if change.reason:
            message += f" ({change.reason})"
        run.notices.append((PROGRESS, {"message": message, "breaker": change.to_dict()}))
