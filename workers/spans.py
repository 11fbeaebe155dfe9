"""Lean spans: what the SDK's tracer records, for a fraction of its cost, into the same export pipeline.

It keeps the SDK's behaviour where it shows: the provider's sampler, id generator and span limits apply, and
a finished span is an SDK ``ReadableSpan`` handed to every span processor of the provider. It leaves out the
SDK's self-metrics, its private ``_on_ending`` hook and ``dropped_*`` counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from time import time_ns
from types import MappingProxyType, TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace import Span as SDKSpan
from opentelemetry.sdk.trace import Tracer as SDKTracer
from opentelemetry.sdk.trace.sampling import ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from broker.otel import SCOPE

_UNSET = Status(StatusCode.UNSET)
_PLAIN = (str, bool, int, float)
# The end of a ParentBased sampler's description when its delegates for parents are the defaults (the
# root's own description comes first, so a nested ParentBased there cannot end the string like this).
_REMOTE_DEFAULTS = ",remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler"
_LOCAL_DEFAULTS = ",localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}"
_FLAGS = {
    (sampled, random): TraceFlags(
        (TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        | (TraceFlags.RANDOM_TRACE_ID if random else 0)
    )
    for sampled in (False, True)
    for random in (False, True)
}


class Provider(TracerProvider):
    """The SDK provider ``otelsdk.setup`` installs: it also lists its span processors for ``LeanTracer``."""

    def __init__(self, **kwargs: Any) -> None:
        self.span_limits: SpanLimits = kwargs.get("span_limits") or SpanLimits()
        kwargs["span_limits"] = self.span_limits
        self.processors: tuple[Any, ...] = ()
        super().__init__(**kwargs)

    def add_span_processor(self, span_processor: Any) -> None:
        super().add_span_processor(span_processor)
        self.processors = (*self.processors, span_processor)

    def get_tracer(self, instrumenting_module_name: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Our scope's spans at a fraction of the SDK tracer's cost, into the same processors; any other
        scope (a host application's instrumentation) gets the SDK's tracer."""
        if instrumenting_module_name == SCOPE:
            return LeanTracer(self, instrumenting_module_name)
        return super().get_tracer(instrumenting_module_name, *args, **kwargs)


def clean(value: Any, max_length: int | None) -> Any:
    """An attribute value as the SDK stores it: primitives as they are (strings cut to ``max_length``),
    sequences as tuples, mappings as dicts, anything else as its ``str``."""
    if isinstance(value, str):
        return value if max_length is None or len(value) <= max_length else value[:max_length]
    if value is None or isinstance(value, bool | int | float | bytes):
        return value
    if isinstance(value, Mapping):
        return {str(k): clean(v, max_length) for k, v in value.items() if k}
    if isinstance(value, Sequence):
        return tuple(clean(v, max_length) for v in value)
    return str(value)


class LeanTracer:
    """``start_span`` of the SDK tracer (the arguments our code passes), making ``LeanSpan``s."""

    def __init__(self, provider: Provider, scope: str) -> None:
        self.provider = provider
        self.scope = InstrumentationScope(scope)  # what the SDK tracer of that name reports
        limits = self.limits = provider.span_limits
        # Plain values are stored as given while there is no length limit, up to this many at once.
        self._as_given: int | None = None
        if limits.max_span_attribute_length is None:
            self._as_given = 1 << 30 if limits.max_span_attributes is None else limits.max_span_attributes
        # A ParentBased sampler with its default delegates follows the parent: decided here without asking
        # it for every span (its description names its delegates).
        sampler = provider.sampler
        described = sampler.get_description() if type(sampler) is ParentBased else ""
        self._follow_local = described.endswith(_LOCAL_DEFAULTS)
        self._follow_remote = described.endswith(_REMOTE_DEFAULTS + _LOCAL_DEFAULTS)

    def start_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        provider = self.provider
        ids = provider.id_generator
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = ids.generate_trace_id()
            random_id = ids.is_trace_id_random()
        else:
            trace_id = parent.trace_id
            random_id = parent.trace_flags.random_trace_id
        state: TraceState | None
        if parent is not None and (self._follow_remote if parent.is_remote else self._follow_local):
            sampled = recording = parent.trace_flags.sampled
            state, extra = parent.trace_state, attributes
        else:
            result = provider.sampler.should_sample(context, trace_id, name, kind, attributes, links)
            sampled, recording = result.decision.is_sampled(), result.decision.is_recording()
            state, extra = result.trace_state, result.attributes
        sc = SpanContext(
            trace_id, ids.generate_span_id(), False, _FLAGS[bool(sampled), bool(random_id)], state
        )
        if not recording:
            return NonRecordingSpan(sc)
        span = LeanSpan(
            self, name, sc, parent, kind, start_time or time_ns(), record_exception, set_status_on_exception
        )
        if extra:
            if self._as_given is not None and len(extra) <= self._as_given:
                for key, value in extra.items():
                    if type(value) not in _PLAIN or type(key) is not str or not key:
                        span.set_attributes(_start_keys(extra))
                        break
                else:
                    span._attributes.update(extra)  # plain values within the limits: nothing to clean or drop
            else:
                span.set_attributes(_start_keys(extra))
        for link in links or ():
            span.add_link(link.context, link.attributes)
        for processor in provider.processors:
            processor.on_start(span, parent_context=context)
        return span

    # The SDK tracer's own: it only calls ``self.start_span`` and ``trace.use_span``.
    start_as_current_span = SDKTracer.start_as_current_span


def _field(slot: str) -> Any:
    return property(lambda self: getattr(self, slot))


class LeanSpan(trace.Span):
    """A recording span; ``end()`` hands an SDK ``ReadableSpan`` to the provider's processors."""

    __slots__ = (
        "_tracer", "_name", "_context", "_parent", "_kind", "_attributes", "_events", "_links", "_status",
        "_start", "_end", "_record_exception", "_status_on_exception", "_open",
    )

    def __init__(
        self, tracer: LeanTracer, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
        start: int, record_exception: bool = True, status_on_exception: bool = True,
    ) -> None:
        self._tracer = tracer
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes: dict[str, Any] = {}
        self._events: list[Event] = []
        self._links: list[Link] = []
        self._status = _UNSET
        self._start = start
        self._end: int | None = None
        self._record_exception = record_exception
        self._status_on_exception = status_on_exception
        self._open = [True]  # emptied by the one end() that exports

    # What a processor may read in on_start.
    name = _field("_name")
    context = _field("_context")
    parent = _field("_parent")
    kind = _field("_kind")
    status = _field("_status")
    start_time = _field("_start")
    end_time = _field("_end")
    attributes = property(lambda self: MappingProxyType(self._attributes))
    events = property(lambda self: tuple(self._events))
    links = property(lambda self: tuple(self._links))
    resource = property(lambda self: self._tracer.provider.resource)
    instrumentation_scope = property(lambda self: self._tracer.scope)

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end is None

    def update_name(self, name: str) -> None:
        if self._end is None:
            self._name = name

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end is not None or not key or not isinstance(key, str):
            return
        limits = self._tracer.limits
        attrs = self._attributes
        if type(value) not in _PLAIN or (type(value) is str and limits.max_span_attribute_length is not None):
            value = clean(value, limits.max_span_attribute_length)
        if key in attrs:
            del attrs[key]  # set again: it becomes the newest, as in the SDK
        elif limits.max_span_attributes is not None and len(attrs) >= limits.max_span_attributes:
            if not limits.max_span_attributes:
                return
            del attrs[next(iter(attrs))]  # the oldest goes, as in the SDK
        attrs[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self._end is not None:
            return
        limits = self._tracer.limits
        attrs = _bounded(attributes, limits.max_event_attributes, limits.max_attribute_length)
        _append(
            self._events, Event(name, attrs, time_ns() if timestamp is None else timestamp), limits.max_events
        )

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._end is not None or not (context and (context.is_valid or attributes or context.trace_state)):
            return
        limits = self._tracer.limits
        attrs = _bounded(attributes, limits.max_link_attributes, limits.max_attribute_length)
        _append(self._links, Link(context, attrs), limits.max_links)

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK: OK is final, UNSET is ignored.
        if self._end is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    # The SDK span's own: it only builds the event's attributes and calls ``self.add_event``.
    record_exception: Callable[..., None] = SDKSpan.record_exception

    def end(self, end_time: int | None = None) -> None:
        try:
            self._open.pop()  # atomic: of two threads ending a span at once, one exports it (no lock)
        except IndexError:
            return
        self._end = end_time or time_ns()
        tracer = self._tracer
        finished = ReadableSpan(
            name=self._name, context=self._context, parent=self._parent, resource=tracer.provider.resource,
            attributes=dict(self._attributes), events=tuple(self._events), links=tuple(self._links),
            kind=self._kind, status=self._status, start_time=self._start, end_time=self._end,
            instrumentation_scope=tracer.scope,
        )
        for processor in tracer.provider.processors:
            processor.on_end(finished)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # As the SDK's span used as a context manager: the exception recorded and the status set, if asked.
        if exc is not None and self.is_recording():
            if self._record_exception:
                self.record_exception(exc, escaped=True)
            if self._status_on_exception:
                self.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self.end()

    def __repr__(self) -> str:
        return f"LeanSpan(name={self._name!r}, context={self._context!r})"


def _start_keys(attributes: Mapping[Any, Any]) -> dict[Any, Any]:
    # As the SDK cleans a span's first attributes: a number or bool key becomes its str (set_attribute
    # then drops any other key that is not a non-empty str).
    return {str(k) if type(k) in _PLAIN[1:] else k: v for k, v in attributes.items()}


def _append(items: list[Any], item: Any, limit: int | None) -> None:
    # Over a limit the oldest goes, as in the SDK's bounded lists.
    if limit is not None:
        if limit <= 0:
            return
        if len(items) >= limit:
            del items[0]
    items.append(item)


def _bounded(
    attributes: Mapping[str, Any] | None, count: int | None, length: int | None
) -> dict[str, Any] | None:
    if not attributes:
        return None
    out = {str(k): clean(v, length) for k, v in attributes.items() if k}
    if count is not None and len(out) > count:
        out = dict(list(out.items())[-count:]) if count else {}
    return out
