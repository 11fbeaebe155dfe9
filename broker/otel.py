"""The OpenTelemetry API as the client and the workers use it (which tracer and meter, W3C context in and
out of envelopes, marking a span failed) and the W3C ``traceparent`` header, which an envelope carries
whether tracing is on or not. Only the API is imported here: ``workers.otelsdk`` installs the SDK.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import (
    NonRecordingSpan,
    NoOpTracerProvider,
    ProxyTracerProvider,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from broker.logs import redact_text

SCOPE = "hermes_gateway"
MESSAGING_SYSTEM = "rq"
_W3C = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
_EMPTY = otel_context.Context()
_NO_STATE = TraceState()
_HEX = frozenset("0123456789abcdef")

_KEEP: Any = object()
_OVERRIDES: dict[str, list[Any]] = {"tracer": [None], "meter": [None]}  # a test's providers, or None


def use_providers(tracer_provider: Any = _KEEP, meter_provider: Any = _KEEP) -> None:
    """Route our spans / metrics to these providers instead of the global ones (tests, benchmarks); only
    what is passed changes, and no arguments at all goes back to the global providers for both."""
    if tracer_provider is _KEEP and meter_provider is _KEEP:
        tracer_provider = meter_provider = None
    if tracer_provider is not _KEEP:
        _OVERRIDES["tracer"][0] = tracer_provider
    if meter_provider is not _KEEP:
        _OVERRIDES["meter"][0] = meter_provider


def providers() -> tuple[Any, Any]:
    """The tracer and meter providers in force (a test's, else the global ones)."""
    return (
        _OVERRIDES["tracer"][0] or trace.get_tracer_provider(),
        _OVERRIDES["meter"][0] or metrics.get_meter_provider(),
    )


# While no SDK provider is installed, OTel's get_*_provider() reads os.environ on every call: a "none yet"
# answer is trusted for a second. A global SDK provider can only be set once: a real one is kept for good.
_RECHECK = 1.0


def _finder(
    kind: str, get_global: Callable[[], Any], usable: Callable[[Any], bool], make: Callable[[Any], Any]
) -> Callable[[], Any]:
    """``tracer()`` or ``meter()``: ours from the provider in force when it is an SDK one, else None."""
    override = _OVERRIDES[kind]
    cache: tuple[Any, Any, bool] | None = None  # (provider, ours, provider is the global one)
    checked = 0.0

    def find() -> Any:
        nonlocal cache, checked
        if override[0] is None:
            if cache is not None and cache[2]:
                return cache[1]
            now = time.monotonic()
            if cache is None and now - checked < _RECHECK:
                return None
            checked = now
        provider = override[0] or get_global()
        if cache is not None and cache[0] is provider:
            return cache[1]
        if not usable(provider):
            cache = None
            return None
        found = make(provider)
        cache = (provider, found, override[0] is None)
        return found

    return find


def _is_sdk_tracer_provider(provider: Any) -> bool:
    return not isinstance(provider, ProxyTracerProvider | NoOpTracerProvider)


def _is_sdk_meter_provider(provider: Any) -> bool:
    # The API's global stand-in is a private type: an SDK provider is told apart by its force_flush().
    return not isinstance(provider, NoOpMeterProvider) and callable(getattr(provider, "force_flush", None))


# Our tracer / meter when an SDK provider is set (here or by the host application), else None: skip them.
tracer = _finder("tracer", trace.get_tracer_provider, _is_sdk_tracer_provider, lambda p: p.get_tracer(SCOPE))
meter = _finder("meter", metrics.get_meter_provider, _is_sdk_meter_provider, lambda p: p.get_meter(SCOPE))


# -- W3C context -------------------------------------------------------------------------------


def parent_context(
    traceparent: str | None, tracestate: str | None = None, baggage: str | None = None
) -> otel_context.Context:
    """The OpenTelemetry context a W3C ``traceparent``/``tracestate``/``baggage`` triple describes."""
    if tracestate and len(tracestate) > TRACESTATE_MAX:
        tracestate = _truncated(tracestate)
    fast = _fast_parent(traceparent, tracestate) if not baggage else None
    if fast is not None:
        return fast
    carrier = {"traceparent": traceparent or ""}
    if tracestate:
        carrier["tracestate"] = tracestate
    if baggage:
        carrier["baggage"] = baggage
    return _W3C.extract(carrier, context=otel_context.Context())


TRACESTATE_MAX = 512  # W3C: what every vendor must propagate, and the bound it truncates to


def _truncated(tracestate: str) -> str:
    # W3C Trace Context's truncation: members over 128 characters go first, then from the end until
    # the header fits. (OpenTelemetry logs an invalid member whole: a 60 KB header became a 60 KB line.)
    kept: list[str] = []
    size = -1
    for member in tracestate.split(","):
        member = member.strip()
        if not member or len(member) > 128:
            continue
        if size + 1 + len(member) > TRACESTATE_MAX:
            break
        kept.append(member)
        size += 1 + len(member)
    return ",".join(kept)


def _fast_parent(traceparent: str | None, tracestate: str | None) -> otel_context.Context | None:
    # A well-formed version-00 header parsed without the propagators (a per-call cost); anything else
    # takes the full path.
    if not traceparent or len(traceparent) != 55 or not traceparent.startswith("00-"):
        return None
    if traceparent[35] != "-" or traceparent[52] != "-" or not _HEX.issuperset(traceparent[3:35]):
        return None
    if not _HEX.issuperset(traceparent[36:52]) or not _HEX.issuperset(traceparent[53:]):
        return None
    trace_id, span_id = int(traceparent[3:35], 16), int(traceparent[36:52], 16)
    if not trace_id or not span_id:
        return _EMPTY
    state = TraceState.from_header([tracestate]) if tracestate else _NO_STATE
    sc = SpanContext(trace_id, span_id, True, TraceFlags(int(traceparent[53:], 16)), state)
    return trace.set_span_in_context(NonRecordingSpan(sc), _EMPTY)


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


# -- W3C trace context: parse and mint ``traceparent`` headers ----------------------------------------

# Ids need to be unique, not secret: a PRNG seeded from the OS (reseeded in a forked child), not a system
# call per id.
_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)

_TP = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """Return ``(trace_id, span_id)`` of a valid traceparent, else None."""
    if not value:
        return None
    m = _TP.match(value.strip().lower())
    if not m or m.group(1) == "ff" or set(m.group(2)) == {"0"} or set(m.group(3)) == {"0"}:
        return None
    return m.group(2), m.group(3)


def random_hex(nbytes: int) -> str:
    """``nbytes`` random bytes as hex, never all zeros (W3C forbids zero ids)."""
    return f"{_rng.getrandbits(nbytes * 8) or 1:0{nbytes * 2}x}"


def new_span_id() -> str:
    return random_hex(8)


def ensure_traceparent(value: str | None) -> str:
    """The caller's traceparent when valid, else the start of a new (sampled) trace."""
    if parse_traceparent(value):
        return value.strip().lower()  # type: ignore[union-attr]
    return f"00-{random_hex(16)}-{random_hex(8)}-01"
