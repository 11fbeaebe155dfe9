"""Per-call concerns as hooks (the shape of Dramatiq's middleware): the ``Hook`` base class, and the hooks
with no module of their own concern.

The runner calls a stage's ``before_*`` in ``HOOKS`` order and its ``after_*`` in reverse, also when the stage
raised, for the hooks whose ``before_*`` returned (docs/ARCHITECTURE.md describes the stages). Hooks never
move the call; what the caller should hear goes to ``run.notices``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from broker import logs
from broker.audit import AuditRecord, context_fields
from broker.breaker import BreakerConfig, Breakers, Change, breaker_config
from broker.errors import CallCancelled, CircuitOpen, HermesError, ToolTimeout
from broker.events import PROGRESS
from broker.toolspec import ToolSpec
from workers.args import validate_args
from workers.executors import PerSpec

if TYPE_CHECKING:
    from workers.runner import Running, WorkerCore


Writer = Callable[[Any], None]  # more writes in the terminal move's pipeline


class Hook:
    """One per-call concern; override the stages it takes part in (the others are skipped)."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def before_call(self, run: Running) -> None: ...

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None: ...

    def before_flow(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_flow(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def before_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_checks(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def before_chain(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_chain(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def before_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_execute(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        return None


def hooked(hook: Hook, name: str) -> Callable[..., Any] | None:
    """``hook``'s method ``name``, or None where it keeps the base's no-op (the runner skips those)."""
    return getattr(hook, name) if getattr(type(hook), name) is not getattr(Hook, name) else None


class AuditRecordHook(Hook):
    """A call's audit record (``broker/audit.py``), appended in the pipeline of its terminal move."""

    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        env, info = run.env, run.info
        record = AuditRecord.of(
            call_id=info.call_id,
            kind=info.kind,
            state=state,
            args=run.args if run.args is not None else (env.args if env is not None else None),
            sensitive=run.sensitive,
            digest=self.core.audit.digest_now() if run.sensitive else None,
            result=result if state == "done" else None,
            request=run.request or (env.request if env is not None and env.kind == "llm" else None),
            error=error,
            tool_name=info.name if info.kind == "tool" else None,
            **context_fields(env.context if env is not None else {}),
            trace_id=info.trace_id,
            duration_ms=round(duration * 1000, 3),
            status_code=_status_code(run, error),
            attempts=run.attempt,
            middleware_trace=run.middleware_trace,
            usage=run.usage,
        )
        audit = self.core.audit
        return lambda pipe: audit.append(record, pipeline=pipe)


def _status_code(run: Running, error: dict[str, Any] | None) -> int | str | None:
    """The back end's status for the audit record: what the executor saw, else what its error names."""
    if run.ctx is not None and run.ctx.status_code is not None:
        return run.ctx.status_code
    details = (error or {}).get("details") or {}
    for key in ("status", "exit_code"):
        value = details.get(key) if isinstance(details, dict) else None
        if isinstance(value, int | str) and not isinstance(value, bool):
            return value
    return None


# Ends that are not the call's end (it runs again, here or elsewhere): DEBUG, the next attempt logs its own.
NOT_ENDED = frozenset(("retrying", "handed_back", "lost"))


class CallLog(Hook):
    """``call started`` (DEBUG) and ``call finished`` (INFO; WARNING with the error when failed); the runner
    binds the call's ids in contextvars."""

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


log = structlog.get_logger("hermes.breaker")


class Circuit(Hook):
    """A tool's circuit breaker (``broker/breaker.py``): checked before the tool_execution middleware chain
    (open: CircuitOpen, and no middleware runs) and told the executor's outcome after it; a change is
    logged, counted, published and told the caller."""

    def __init__(self, core: WorkerCore) -> None:
        super().__init__(core)
        configs = PerSpec(lambda spec: breaker_config(core.settings, spec))  # once per spec object
        self.config: Callable[[ToolSpec], BreakerConfig | None] = configs.get

    @functools.cached_property
    def breakers(self) -> Breakers:
        return Breakers(self.core.conn)

    def before_chain(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        """Before the tool_execution middleware chain (DESIGN.md: breaker check, then the chain)."""
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

    def after_chain(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        """The chain ended without reaching the executor (a middleware answered or failed first): its probe,
        if it held one, is given back without an outcome."""
        if run.breaker is not None:
            self._record(run, None, neutral=True)

    def after_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        # A timeout the caller made shorter than the spec's is the caller's doing, not the back end's: it
        # does not count (one principal's 1 ms timeouts would open the tool's breaker for everyone); nor does
        # the back end refusing what the caller sent (HTTP 4xx, a query the database refused: not retryable).
        asked = run.env.options.timeout if run.env is not None and isinstance(error, ToolTimeout) else None
        refused = error is not None and not getattr(error, "retryable", True)
        self._record(run, error, callers=refused or (asked is not None and 0 < asked < spec.timeout))

    def _record(self, run: Running, error: BaseException | None, neutral: bool = False, callers: bool = False) -> None:
        if run.breaker is None:
            return
        (cfg, probe), run.breaker = run.breaker, None
        outcome, etype = "ok", ""
        if neutral or isinstance(error, CallCancelled):
            outcome = "neutral"
        elif error is not None:
            etype = error.type if isinstance(error, HermesError) else "internal_error"
            outcome = "fail" if cfg.counts(etype) and not callers else "neutral"
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
        from workers.telemetry import breaker_changed  # (telemetry defines hooks and imports this module)

        breaker_changed(change.key, change.previous, change.state)
        breakers = self.breakers
        self.core.outbox.put(lambda pipe: breakers.publish(change, pipe))
        message = f"circuit breaker {change.key!r}: {change.previous} -> {change.state}"
        if change.reason:
            message += f" ({change.reason})"
        run.notices.append((PROGRESS, {"message": message, "breaker": change.to_dict()}))


class Checks(Hook):
    """The contract's policy step: the active policy, then the tool's input schema (here, not in policy.py:
    a client that reads the policy does not load the argument validator)."""

    def before_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        run.args = args  # the audit record keeps the arguments the checks saw, refused or not
        self.core.policy.enforce(run.env.context.get("principal"), spec, args)
        validate_args(spec.input_schema, args, spec.name)
