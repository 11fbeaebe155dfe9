"""Client-side tracing: the SDK set-up for the CLI, and a submission's ``send <queue>`` PRODUCER span
(one per batch) whose context rides in the envelope(s) for the worker's ``process`` span. With no SDK
provider there is no span: the envelope carries the caller's context as it is."""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from broker import otel
from broker.config import TRACE_ENV, TelemetrySettings
from broker.envelope import Envelope
from broker.otel import MESSAGING_SYSTEM, headers_of, mark_failed, parent_context

Headers = tuple[str | None, str | None, str | None]  # traceparent, tracestate, baggage


def setup(telemetry: TelemetrySettings, mode: str | None = None) -> str:
    """Install the SDK in this process (``--trace``, else ``HERMES_TRACE`` / ``OTEL_*``); workers started
    from here inherit it."""
    from workers import otelsdk  # the SDK: only a process that exports spans loads it

    if mode:
        os.environ[TRACE_ENV] = mode  # written, not read: the environment of the workers this command starts
    return otelsdk.setup("hermes-gateway", telemetry, mode)


class Sending:
    """The producer span of one submission or one batch; ``headers`` go into the envelope(s)."""

    def __init__(self, traceparent: str | None = None, tracestate: str | None = None) -> None:
        tracer = otel.tracer()
        # (None: the current context)
        parent = parent_context(traceparent, tracestate, headers_of()[2]) if traceparent is not None else None
        self.span: Any = None
        if tracer is None:
            self.headers: Headers = (traceparent, tracestate, None) if traceparent else headers_of()
            return
        self.span = tracer.start_span(
            "send",
            context=parent,
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": MESSAGING_SYSTEM,
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
            },
        )
        self.headers = headers_of(trace.set_span_in_context(self.span, parent))

    def describe(self, env: Envelope | None, count: int = 1) -> None:
        """Name the span after the destination and tag it with the message (or the batch size)."""
        if self.span is None or env is None:
            return
        self.span.update_name(f"send {env.queue}")
        attrs: dict[str, Any] = {"messaging.destination.name": env.queue}
        if count == 1:
            attrs["messaging.message.id"] = env.call_id
            if env.kind == "tool":
                attrs["gen_ai.tool.name"] = env.tool or ""
            else:
                attrs["gen_ai.request.model"] = env.name
        else:
            attrs["messaging.batch.message_count"] = count
        self.span.set_attributes(attrs)

    def __enter__(self) -> Sending:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.span is None:
            return
        if exc is not None:
            mark_failed(self.span, exc)
        self.span.end()
