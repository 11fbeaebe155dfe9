"""Spans of one call in a worker, after the OpenTelemetry messaging and GenAI conventions.

``process <queue>`` (CONSUMER) continues the caller's trace from the envelope's W3C context and links
to the producer span; under it: ``tool_request`` (request middleware, when any is registered),
``policy``, ``tool_execution`` (the execution middleware chain, when any), ``execute_tool <tool>``
(the executor; the executors forward *its* context to the back end) and ``chat <model>`` (a provider
call). Retries are span events. Failures set status ERROR and ``error.type``. Every string that
could carry a secret goes through ``broker.redact`` first.

With tracing off (no SDK provider) ``CallTrace.start`` returns ``NO_TRACE``, whose methods do nothing,
so the call path never branches and pays almost nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from broker.errors import CallCancelled
from broker.redact import redact, redact_text
from workers import otelsdk

if TYPE_CHECKING:
    from broker.envelope import Envelope

MESSAGING_SYSTEM = "rq"
ARGS_LIMIT = 1024
_W3C = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
_NULL: AbstractContextManager[Any] = nullcontext()


# -- W3C context -------------------------------------------------------------------------------


def parent_context(
    traceparent: str | None, tracestate: str | None = None, baggage: str | None = None
) -> otel_context.Context:
    """The OpenTelemetry context a W3C ``traceparent``/``tracestate``/``baggage`` triple describes."""
    carrier = {"traceparent": traceparent or ""}
    if tracestate:
        carrier["tracestate"] = tracestate
    if baggage:
        carrier["baggage"] = baggage
    return _W3C.extract(carrier, context=otel_context.Context())


def headers_of(ctx: otel_context.Context | None = None) -> tuple[str | None, str | None, str | None]:
    """``(traceparent, tracestate, baggage)`` of a context (default: the current one); None where absent."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=ctx)
    return carrier.get("traceparent"), carrier.get("tracestate"), carrier.get("baggage")


def traceparent_of(span: Any) -> str:
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


# -- errors ------------------------------------------------------------------------------------


def error_type(error: BaseException | Mapping[str, Any]) -> str:
    """The stable ``error.type`` of an exception or a wire error (``{"type": ...}``)."""
    if isinstance(error, Mapping):
        return str(error.get("type") or "error")
    return str(getattr(error, "type", None) or type(error).__qualname__)


def mark_failed(span: Any, error: BaseException | Mapping[str, Any]) -> None:
    """Status ERROR, ``error.type`` and a redacted ``exception`` event (no stack: frames can hold values)."""
    message = str(error.get("message") or "") if isinstance(error, Mapping) else str(error)
    clean = redact_text(message)[:500]
    span.set_attribute("error.type", error_type(error))
    span.set_status(Status(StatusCode.ERROR, clean))
    if isinstance(error, BaseException):
        span.add_event("exception", {"exception.type": type(error).__qualname__, "exception.message": clean})


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
    text = json.dumps(redact(dict(args or {}), sensitive), ensure_ascii=False, default=str)
    return text if len(text) <= ARGS_LIMIT else text[: ARGS_LIMIT - 1] + "…"


@contextmanager
def _span(tracer: Any, name: str, parent: Any, kind: SpanKind, attributes: dict[str, Any]) -> Iterator[Any]:
    span = tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    try:
        yield span
    except CallCancelled:
        span.add_event("cancelled")
        raise
    except BaseException as e:
        mark_failed(span, e)
        raise
    finally:
        otel_context.detach(token)
        span.end()


# -- one call ----------------------------------------------------------------------------------


class NoTrace:
    """Tracing off: every method does nothing."""

    span_id: str | None = None
    span: Any = None

    def open(self, name: str) -> None:
        return None

    def close(self, name: str) -> None:
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
    """The spans of one call in this worker: ``process <queue>`` and its children."""

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
        )
        self.ctx = trace.set_span_in_context(self.span, parent)
        self.span_id = f"{self.span.get_span_context().span_id:016x}"
        self._token: Any = otel_context.attach(self.ctx)
        self._open: dict[str, Any] = {}
        self._chain: Any = None
        self._ended = False

    @classmethod
    def start(cls, env: Envelope, attempt: int, claimed_at: float | None = None) -> NoTrace:
        """The call's trace when tracing is on, else ``NO_TRACE``."""
        tracer = otelsdk.tracer()
        if tracer is None:
            return NO_TRACE
        return cls(tracer, env, attempt, time.time() if claimed_at is None else claimed_at)

    def _parent(self) -> Any:
        return trace.set_span_in_context(self._chain, self.ctx) if self._chain is not None else self.ctx

    # -- phases ----------------------------------------------------------------------------------

    def open(self, name: str) -> None:
        """Start a phase span that callbacks end later (``tool_request`` ends when the checks begin)."""
        if name not in self._open:
            span = self.tracer.start_span(name, context=self._parent(), kind=SpanKind.INTERNAL)
            self._open[name] = span
            if name == "tool_execution":
                self._chain = span

    def close(self, name: str) -> None:
        span = self._open.pop(name, None)
        if span is not None:
            span.end()
        if name == "tool_execution":
            self._chain = None

    def phase(self, name: str, **attributes: Any) -> AbstractContextManager[Any]:
        return _span(self.tracer, name, self._parent(), SpanKind.INTERNAL, attributes)

    def executor(
        self, spec: Any, args: Mapping[str, Any], ctx: Any, sensitive: Sequence[str] = ()
    ) -> AbstractContextManager[Any]:
        """``execute_tool <tool>``; the executor forwards this span's context (``ctx.traceparent``)."""
        return self._executor(spec, args, ctx, sensitive)

    @contextmanager
    def _executor(
        self, spec: Any, args: Mapping[str, Any], ctx: Any, sensitive: Sequence[str]
    ) -> Iterator[Any]:
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": spec.name,
            "gen_ai.tool.call.id": self.tool_call_id,
            "gen_ai.tool.type": "function",
            "gen_ai.tool.call.arguments": _args_attribute(args, sensitive),
            "hermes.executor": spec.executor,
        }
        with _span(
            self.tracer, f"execute_tool {spec.name}", self._parent(), SpanKind.INTERNAL, attributes
        ) as s:
            ctx.traceparent = traceparent_of(s)
            state = s.get_span_context().trace_state
            ctx.tracestate = state.to_header() if state else None
            yield s

    def provider(self, model: str, provider: str, ctx: Any) -> AbstractContextManager[Any]:
        """``chat <model>`` around one provider request; the provider forwards this span's context."""
        return self._provider(model, provider, ctx)

    @contextmanager
    def _provider(self, model: str, provider: str, ctx: Any) -> Iterator[Any]:
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "hermes.attempt": getattr(ctx, "attempt", 1),
        }
        with _span(self.tracer, f"chat {model}", self._parent(), SpanKind.CLIENT, attributes) as s:
            ctx.traceparent = traceparent_of(s)
            yield s

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
        """Leave the call's context (same thread that started it); ends the span if ``end`` was not called."""
        if not self._ended:
            self.end("abandoned")
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None


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
