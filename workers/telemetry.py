"""Spans of one call in a worker, after the OpenTelemetry messaging and GenAI conventions.

``process <queue>`` (CONSUMER) continues the caller's trace from the envelope's W3C context and links
to the producer span; under it: ``tool_request`` (request middleware, when any is registered),
``policy``, ``tool_execution`` (the execution middleware chain, when any), ``execute_tool <tool>``
(the executor; the executors forward *its* context to the back end) and ``chat <model>`` (a provider
call). Retries are span events. Failures set status ERROR and ``error.type``. Every string that
could carry a secret goes through ``broker.logs.redact`` first.

With tracing off (no SDK provider) ``CallTrace.start`` returns ``NO_TRACE``, whose methods do nothing,
so the call path never branches and pays almost nothing.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import (
    Link,
    SpanKind,
)

from broker import otel
from broker.errors import CallCancelled
from broker.logs import redact, redact_text
from broker.otel import MESSAGING_SYSTEM, error_type, mark_failed, parent_context, traceparent_of
from workers.hooks import Hook

if TYPE_CHECKING:
    from broker.envelope import Envelope
    from broker.toolspec import ToolSpec
    from workers.runner import Running


ARGS_LIMIT = 1024
_NULL: AbstractContextManager[Any] = nullcontext()


def retry_event(span: Any, attempt: int, delay: float, error: BaseException | Mapping[str, Any]) -> None:
    """A retry as a span event: which attempt failed, why, and the wait before the next one."""
    message = str(error.get("message") or "") if isinstance(error, Mapping) else str(error)
    span.add_event(
        "retry",
        {
            "hermes.attempt": attempt,
            "hermes.retry.delay_s": round(delay, 3),
            "error.type": error_type(error),
            "exception.message": redact_text(message)[:500],
        },
    )


def _args_attribute(args: Mapping[str, Any] | None, sensitive: Sequence[str]) -> str:
    if not args:
        return "{}"
    text = json.dumps(redact(dict(args or {}), sensitive), ensure_ascii=False, default=str)
    return text if len(text) <= ARGS_LIMIT else text[: ARGS_LIMIT - 1] + "…"


class _Phase:
    """A span we end ourselves on leaving; ``ctx`` set: that context is current meanwhile (executors)."""

    __slots__ = ("span", "ctx", "_token")

    def __init__(self, span: Any, ctx: otel_context.Context | None = None) -> None:
        self.span = span
        self.ctx = ctx
        self._token: Any = None

    def __enter__(self) -> Any:
        if self.ctx is not None:
            self._token = otel_context.attach(self.ctx)
        return self.span

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        span = self.span
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None
        _ended(span, exc)


def _ended(span: Any, exc: BaseException | None) -> None:
    if exc is not None:
        if isinstance(exc, CallCancelled):
            span.add_event("cancelled")
        else:
            mark_failed(span, exc)
    span.end()


def _start(tracer: Any, name: str, parent: Any, kind: SpanKind, attributes: dict[str, Any]) -> Any:
    # We end (and mark) our spans ourselves, so the SDK's own exception recording stays off.
    return tracer.start_span(
        name,
        context=parent,
        kind=kind,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    )


# -- one call ----------------------------------------------------------------------------------


class NoTrace:
    """Tracing off: every method does nothing."""

    span_id: str | None = None
    span: Any = None

    def open(self, name: str) -> None:
        return None

    def close(self, name: str, error: BaseException | None = None) -> None:
        return None

    def phase(self, name: str, **attributes: Any) -> AbstractContextManager[Any]:
        return _NULL

    def executor(
        self, spec: Any, args: Mapping[str, Any], ctx: Any, sensitive: Sequence[str] = ()
    ) -> AbstractContextManager[Any]:
        return _NULL

    def provider(self, model: str, provider: str, ctx: Any) -> AbstractContextManager[Any]:
        return _NULL

    def retry(self, attempt: int, delay: float, error: BaseException | Mapping[str, Any]) -> None:
        return None

    def end(self, state: str, error: Mapping[str, Any] | None = None) -> None:
        return None

    def finish(self) -> None:
        return None


NO_TRACE = NoTrace()


class CallTrace(NoTrace):
    """The spans of one call in this worker: ``process <queue>`` and its children.

    Children get their parent passed explicitly; the OpenTelemetry context is made current only around
    the executor and the provider (user code that reads baggage or opens spans of its own runs there).
    """

    def __init__(self, tracer: Any, env: Envelope, attempt: int, claimed_at: float) -> None:
        self.tracer = tracer
        parent = parent_context(env.traceparent, env.tracestate, env.baggage)
        caller = trace.get_current_span(parent).get_span_context()
        wait = max(0.0, claimed_at - float(env.submitted_at))
        attributes: dict[str, Any] = {
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": env.queue,
            "messaging.message.id": env.call_id,
            "hermes.call.kind": env.kind,
            "hermes.call.attempt": attempt,
            "hermes.queue.wait_ms": round(wait * 1000, 3),
        }
        tool_call_id = env.context.get("tool_call_id")
        self.tool_call_id = str(tool_call_id or env.call_id)
        if env.kind == "tool":
            attributes["gen_ai.tool.name"] = env.tool or ""
            if tool_call_id:
                attributes["gen_ai.tool.call.id"] = str(tool_call_id)
        else:
            attributes["gen_ai.request.model"] = env.name
        if env.context.get("session_id"):
            attributes["session.id"] = str(env.context["session_id"])
        # Parent: the producer span (one message, so the creation context is the parent); also a link.
        self.span = tracer.start_span(
            f"process {env.queue}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=[Link(caller)] if caller.is_valid else None,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
        self.ctx = trace.set_span_in_context(self.span, parent)
        self.span_id = f"{self.span.get_span_context().span_id:016x}"
        self._open: dict[str, Any] = {}
        self._chain_ctx: Any = None  # the tool_execution span's context while it is open
        self._ended = False

    @classmethod
    def start(cls, env: Envelope, attempt: int, claimed_at: float | None = None) -> NoTrace:
        """The call's trace when tracing is on, else ``NO_TRACE``."""
        tracer = otel.tracer()
        if tracer is None:
            return NO_TRACE
        return cls(tracer, env, attempt, time.time() if claimed_at is None else claimed_at)

    def _parent(self) -> Any:
        return self._chain_ctx if self._chain_ctx is not None else self.ctx

    # -- phases ----------------------------------------------------------------------------------

    def open(self, name: str) -> None:
        """Start a phase span that callbacks end later (``tool_request`` ends when the checks begin)."""
        if name not in self._open:
            span = _start(self.tracer, name, self._parent(), SpanKind.INTERNAL, {})
            self._open[name] = span
            if name == "tool_execution":
                self._chain_ctx = trace.set_span_in_context(span, self.ctx)

    def close(self, name: str, error: BaseException | None = None) -> None:
        """End a phase span ``open`` started (marked failed when ``error`` ended it)."""
        span = self._open.pop(name, None) if self._open else None
        if span is not None:
            _ended(span, error)
        if name == "tool_execution":
            self._chain_ctx = None

    def phase(self, name: str, **attributes: Any) -> AbstractContextManager[Any]:
        return _Phase(_start(self.tracer, name, self._parent(), SpanKind.INTERNAL, attributes))

    def executor(
        self, spec: Any, args: Mapping[str, Any], ctx: Any, sensitive: Sequence[str] = ()
    ) -> AbstractContextManager[Any]:
        """``execute_tool <tool>``; the executor forwards this span's context (``ctx.traceparent``)."""
        attributes = dict(_tool_attributes(spec.name, spec.executor))
        attributes["gen_ai.tool.call.id"] = self.tool_call_id
        attributes["gen_ai.tool.call.arguments"] = _args_attribute(args, sensitive)
        parent = self._parent()
        span = _start(self.tracer, f"execute_tool {spec.name}", parent, SpanKind.INTERNAL, attributes)
        sc = span.get_span_context()
        ctx.traceparent = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"
        state = sc.trace_state
        ctx.tracestate = state.to_header() if state else None
        return _Phase(span, trace.set_span_in_context(span, parent))

    def provider(self, model: str, provider: str, ctx: Any) -> AbstractContextManager[Any]:
        """``chat <model>`` around one provider request; the provider forwards this span's context."""
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "hermes.attempt": getattr(ctx, "attempt", 1),
        }
        parent = self._parent()
        span = _start(self.tracer, f"chat {model}", parent, SpanKind.CLIENT, attributes)
        ctx.traceparent = traceparent_of(span)
        return _Phase(span, trace.set_span_in_context(span, parent))

    def retry(self, attempt: int, delay: float, error: BaseException | Mapping[str, Any]) -> None:
        retry_event(self.span, attempt, delay, error)

    # -- the end -----------------------------------------------------------------------------------

    def end(self, state: str, error: Mapping[str, Any] | None = None) -> None:
        """Record the call's outcome and end every span still open (once)."""
        if self._ended:
            return
        self._ended = True
        for name in list(self._open):
            self.close(name)
        self.span.set_attribute("hermes.call.state", state)
        if error is not None and state != "cancelled":
            mark_failed(self.span, error)
        self.span.end()

    def finish(self) -> None:
        """The call is over here: ends the span if ``end`` was not called."""
        if not self._ended:
            self.end("abandoned")


@functools.lru_cache(maxsize=1024)
def _tool_attributes(name: str, executor: str) -> Mapping[str, Any]:
    # The executor span's attributes that depend on the tool alone: built once per tool.
    return {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.type": "function",
        "hermes.executor": executor,
    }


def record_usage(span: Any, response: Any) -> None:
    """``gen_ai.usage.*`` and response attributes from a chat completion."""
    if span is None or not isinstance(response, Mapping):
        return
    usage = response.get("usage")
    if isinstance(usage, Mapping):
        for ours, theirs in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
            value = usage.get(theirs, usage.get(ours))
            if isinstance(value, int) and not isinstance(value, bool):
                span.set_attribute(f"gen_ai.usage.{ours}", value)
    if response.get("model"):
        span.set_attribute("gen_ai.response.model", str(response["model"]))
    if response.get("id"):
        span.set_attribute("gen_ai.response.id", str(response["id"]))
    reasons = [
        str(c.get("finish_reason"))
        for c in response.get("choices") or []
        if isinstance(c, Mapping) and c.get("finish_reason")
    ]
    if reasons:
        span.set_attribute("gen_ai.response.finish_reasons", reasons)


# -- the hook: a tool call's phase spans -------------------------------------------------------------
# A tool call's phase spans under ``process <queue>``: ``tool_request`` (request middleware, when any),
# ``policy`` (the checks), ``tool_execution`` (the execution chain, when any) and ``execute_tool <tool>``
# around the executor (``workers/telemetry.py``; every method does nothing when tracing is off).

class CallSpans(Hook):
    def _registered(self, run: Running, stage: str) -> bool:
        return run.trace.span is not None and self.core.plugins.runtime.has_middleware(stage)

    def before_flow(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        if self._registered(run, "tool_request"):
            run.trace.open("tool_request")

    def before_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        run.trace.close("tool_request")
        run.trace.open("policy")

    def after_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        run.trace.close("policy", error)
        if error is None and self._registered(run, "tool_execution"):
            run.trace.open("tool_execution")

    def before_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        # The executors forward ctx.traceparent: the executor span's context, so the back end's parent is it.
        run.span = run.trace.executor(spec, args, run.ctx, spec.sensitive)
        run.span.__enter__()

    def after_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        span, run.span = run.span, None
        if span is not None:
            span.__exit__(type(error) if error is not None else None, error, None)

    def after_flow(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        run.trace.close("tool_execution")

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None:
        run.trace.end(outcome, error)
