"""The parts of the OpenTelemetry SDK the lean tracer (``workers/spans.py``) builds on, one test each.

The lean tracer is kept because it pays (ARCHITECTURE, "Lean spans"), and pyproject pins the SDK to the
versions these tests cover: an upgrade that moves any of this fails here, not in a user's worker.
"""

from __future__ import annotations

import inspect

from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import TraceFlags

from workers.spans import _LOCAL_DEFAULTS, _REMOTE_DEFAULTS, LeanTracer, Provider


def test_a_tracer_provider_exposes_its_sampler_id_generator_and_resource() -> None:
    provider = TracerProvider()
    assert isinstance(provider.sampler, Sampler)
    assert isinstance(provider.id_generator, RandomIdGenerator)
    assert provider.resource.attributes.get("telemetry.sdk.name") == "opentelemetry"


def test_the_id_generator_says_whether_its_trace_ids_are_random() -> None:
    assert RandomIdGenerator().is_trace_id_random() is True


def test_trace_flags_carry_the_w3c_random_trace_id_bit() -> None:
    flags = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
    assert flags.sampled and flags.random_trace_id


def test_a_default_parent_based_sampler_describes_its_delegates_as_the_lean_tracer_reads_them() -> None:
    described = ParentBased(ALWAYS_ON).get_description()
    assert described.endswith(_REMOTE_DEFAULTS + _LOCAL_DEFAULTS)
    tracer = LeanTracer(Provider(sampler=ParentBased(ALWAYS_ON)), "t")
    assert tracer._follow_local and tracer._follow_remote


def test_span_limits_have_the_fields_the_lean_tracer_applies() -> None:
    limits = SpanLimits()
    for name in (
        "max_span_attributes",
        "max_span_attribute_length",
        "max_attribute_length",
        "max_event_attributes",
        "max_events",
        "max_link_attributes",
        "max_links",
    ):
        assert hasattr(limits, name), name


def test_a_readable_span_takes_the_keywords_the_lean_span_passes_at_its_end() -> None:
    params = inspect.signature(ReadableSpan).parameters
    for name in (
        "name",
        "context",
        "parent",
        "resource",
        "attributes",
        "events",
        "links",
        "kind",
        "status",
        "start_time",
        "end_time",
        "instrumentation_scope",
    ):
        assert name in params, name
    assert InstrumentationScope("t").name == "t"


def test_the_provider_hands_out_the_lean_tracer_for_our_scope_and_the_sdks_for_others() -> None:
    provider = Provider()
    assert isinstance(provider.get_tracer("hermes_gateway"), LeanTracer)
    assert not isinstance(provider.get_tracer("someone.else"), LeanTracer)


def test_the_sdk_methods_the_lean_classes_borrow_reach_the_span_only_through_its_public_methods() -> None:
    # LeanTracer.start_as_current_span and LeanSpan.record_exception are the SDK's own functions.
    from opentelemetry.sdk.trace import Span, Tracer

    assert "self.start_span(" in inspect.getsource(Tracer.start_as_current_span)
    assert "self.add_event(" in inspect.getsource(Span.record_exception)
    assert "self._" not in inspect.getsource(Span.record_exception)
