"""The lean tracer records what the SDK's tracer records: same sampling, ids, limits, status and export."""

from __future__ import annotations

import io
import json
import threading
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from broker import otel
from broker.otel import parent_context
from workers.spans import LeanTracer, Provider

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def make(**kw: Any) -> tuple[LeanTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = Provider(**kw)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return LeanTracer(provider, otel.SCOPE), exporter


def sdk(**kw: Any) -> tuple[Any, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(**kw)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer(otel.SCOPE), exporter


def shape(span: Any) -> dict[str, Any]:
    """What an exporter reads off a finished span, minus ids and times."""
    return {
        "name": span.name,
        "kind": span.kind,
        "attributes": dict(span.attributes),
        "events": [(e.name, dict(e.attributes or {})) for e in span.events],
        "links": [(link.context.span_id, dict(link.attributes or {})) for link in span.links],
        "status": (span.status.status_code, span.status.description),
        "flags": int(span.context.trace_flags),
        "trace_state": span.context.trace_state.to_header(),
        "parent": None if span.parent is None else ("remote" if span.parent.is_remote else "local"),
        "scope": span.instrumentation_scope.name,
        "resource": sorted(span.resource.attributes),
    }


def scenario(tracer: Any) -> None:
    parent = parent_context(TP, "vendor=abc")
    caller = trace.get_current_span(parent).get_span_context()
    root = tracer.start_span(
        "process tools",
        context=parent,
        kind=SpanKind.CONSUMER,
        links=[Link(caller, {"why": "producer"})],
        attributes={"messaging.system": "rq", "hermes.call.attempt": 2, "ratio": 0.5, "tags": ["a", "b"]},
        record_exception=False,
        set_status_on_exception=False,
    )
    ctx = trace.set_span_in_context(root, parent)
    child = tracer.start_span("execute_tool echo", context=ctx, attributes={"gen_ai.tool.name": "echo"})
    child.add_event("retry", {"hermes.attempt": 1})
    child.set_status(Status(StatusCode.ERROR, "boom"))
    child.set_attribute("error.type", "timeout")
    child.end()
    root.set_attributes({"hermes.call.state": "failed", "odd": object.__name__})
    root.update_name("process tools!")
    root.end()


def test_the_same_spans_as_the_sdk_tracer() -> None:
    lean, got = make()
    full, want = sdk()
    scenario(lean)
    scenario(full)
    assert [shape(s) for s in got.get_finished_spans()] == [shape(s) for s in want.get_finished_spans()]
    root, child = got.get_finished_spans()[1], got.get_finished_spans()[0]
    assert child.parent == root.context and root.parent.span_id == 0x00F067AA0BA902B7
    assert root.context.trace_id == child.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert root.start_time <= child.start_time <= child.end_time <= root.end_time


def test_a_root_span_gets_a_new_trace_id_and_the_sdks_flags() -> None:
    lean, got = make()
    full, want = sdk()
    lean.start_span("a").end()
    full.start_span("a").end()
    (mine,), (theirs,) = got.get_finished_spans(), want.get_finished_spans()
    assert mine.parent is None and mine.context.trace_id != 0
    assert int(mine.context.trace_flags) == int(theirs.context.trace_flags)


def test_the_providers_sampler_decides() -> None:
    tracer, exporter = make(sampler=ALWAYS_OFF)
    span = tracer.start_span("dropped")
    assert isinstance(span, NonRecordingSpan) and not span.is_recording()
    span.end()
    assert exporter.get_finished_spans() == ()
    # Ratio 0 under ParentBased: a sampled remote parent is followed, a new root is not.
    tracer, exporter = make(sampler=ParentBased(TraceIdRatioBased(0.0)))
    tracer.start_span("new root").end()
    followed = tracer.start_span("follows", context=parent_context(TP))
    tracer.start_span("child", context=trace.set_span_in_context(followed)).end()
    followed.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["child", "follows"]
    # Delegates other than the defaults are asked: here a sampled remote parent is not followed.
    tracer, exporter = make(sampler=ParentBased(ALWAYS_ON, remote_parent_sampled=ALWAYS_OFF))
    assert not tracer.start_span("remote child", context=parent_context(TP)).is_recording()
    local = tracer.start_span("new root")
    assert tracer.start_span("local child", context=trace.set_span_in_context(local)).is_recording()


def test_an_unsampled_local_parent_drops_its_children() -> None:
    tracer, exporter = make()
    unsampled = parent_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
    root = tracer.start_span("root", context=unsampled)
    assert not root.is_recording()
    child = tracer.start_span("child", context=trace.set_span_in_context(root))
    assert not child.is_recording() and not child.get_span_context().trace_flags.sampled
    assert exporter.get_finished_spans() == ()


def test_span_limits_as_the_sdk() -> None:
    limits = dict(
        max_span_attributes=2, max_attribute_length=4, max_events=1, max_links=1, max_event_attributes=1
    )
    lean, got = make(span_limits=SpanLimits(**limits))
    full, want = sdk(span_limits=SpanLimits(**limits))
    for tracer in (lean, full):
        span = tracer.start_span("s", attributes={"a": "long value", "b": 1})
        span.set_attribute("c", "xyzzy")  # the oldest ("a") goes
        span.add_event("e1", {"x": 1, "y": 2})
        span.add_event("e2")
        span.add_link(SpanContext(1, 2, False, TraceFlags(1)))
        span.add_link(SpanContext(1, 3, False, TraceFlags(1)))
        span.end()
    (mine,), (theirs,) = got.get_finished_spans(), want.get_finished_spans()
    assert dict(mine.attributes) == dict(theirs.attributes) == {"b": 1, "c": "xyzz"}
    assert [e.name for e in mine.events] == [e.name for e in theirs.events] == ["e2"]  # the newest stay
    for tracer in (lean, full):
        span = tracer.start_span("one event")
        span.add_event("e", {"x": 1, "y": 2})
        span.end()
    assert dict(got.get_finished_spans()[-1].events[0].attributes) == {"y": 2}
    assert dict(want.get_finished_spans()[-1].events[0].attributes) == {"y": 2}
    assert (
        [link.context.span_id for link in mine.links]
        == [link.context.span_id for link in theirs.links]
        == [3]
    )


def test_status_rules_and_record_exception() -> None:
    tracer, exporter = make()
    span = tracer.start_span("s")
    span.set_status(StatusCode.UNSET)  # ignored
    span.set_status(Status(StatusCode.OK))
    span.set_status(Status(StatusCode.ERROR, "late"))  # OK is final
    try:
        raise ValueError("bad input")
    except ValueError as e:
        span.record_exception(e, {"extra": "x"})
    span.end()
    span.set_attribute("after", "end")  # a finished span takes nothing more
    (done,) = exporter.get_finished_spans()
    assert done.status.status_code is StatusCode.OK and "after" not in done.attributes
    (event,) = done.events
    assert event.name == "exception" and event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "bad input" and event.attributes["extra"] == "x"
    assert "Traceback" in event.attributes["exception.stacktrace"]


def test_used_as_a_context_manager_an_error_is_recorded_unless_switched_off() -> None:
    tracer, exporter = make()
    with pytest.raises(RuntimeError), tracer.start_as_current_span("on") as span:
        assert trace.get_current_span() is span
        raise RuntimeError("x")
    with (
        pytest.raises(RuntimeError),
        tracer.start_span("off", record_exception=False, set_status_on_exception=False),
    ):
        raise RuntimeError("y")
    on, off = exporter.get_finished_spans()
    assert on.status.status_code is StatusCode.ERROR and [e.name for e in on.events] == ["exception"]
    assert off.status.status_code is StatusCode.UNSET and off.events == ()


def test_end_exports_once_even_from_two_threads() -> None:
    tracer, exporter = make()
    for _ in range(200):
        span = tracer.start_span("s")
        go = threading.Barrier(2)

        def end(s: Any = span, b: threading.Barrier = go) -> None:
            b.wait()
            s.end()

        threads = [threading.Thread(target=end) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(exporter.get_finished_spans()) == 200


def test_processors_see_start_and_end() -> None:
    seen: list[tuple[str, str]] = []

    class Recorder:
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            seen.append(("start", span.name))  # a starting span reads like the SDK's
            span.set_attribute("added.on.start", True)  # a processor may enrich a starting span

        def on_end(self, span: Any) -> None:
            seen.append(("end", span.name))
            assert span.attributes["added.on.start"] is True

        def shutdown(self) -> None: ...

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    tracer, _ = make()
    tracer.provider.add_span_processor(Recorder())
    tracer.start_span("s").end()
    assert seen == [("start", "s"), ("end", "s")]


def test_console_export_of_a_lean_span() -> None:
    out = io.StringIO()
    provider = Provider()
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=out)))
    tracer = LeanTracer(provider, otel.SCOPE)
    span = tracer.start_span(
        "execute_tool echo", context=parent_context(TP), attributes={"gen_ai.tool.name": "echo"}
    )
    span.end()
    printed = json.loads(out.getvalue())
    assert printed["name"] == "execute_tool echo" and printed["attributes"] == {"gen_ai.tool.name": "echo"}
    assert printed["context"]["trace_id"] == "0x4bf92f3577b34da6a3ce929d0e0e4736"
    assert printed["parent_id"] == "0x00f067aa0ba902b7"


def test_setup_installs_our_provider_and_tracer_hands_out_the_lean_one() -> None:
    otel.use_providers(tracer_provider=Provider())
    try:
        assert isinstance(otel.tracer(), LeanTracer)
        otel.use_providers(tracer_provider=TracerProvider())
        assert not isinstance(otel.tracer(), LeanTracer)  # a provider someone else made: the SDK's tracer
    finally:
        otel.use_providers()


def test_sampler_shortcuts_only_for_the_sdks_own_parent_based_with_default_delegates() -> None:
    asked: list[str] = []

    class Picky(ParentBased):  # same description as ParentBased, its own decisions
        def should_sample(self, parent_context: Any, trace_id: int, name: str, *rest: Any, **kw: Any) -> Any:
            asked.append(name)
            return ALWAYS_OFF.should_sample(parent_context, trace_id, name, *rest, **kw)

    tracer, _ = make(sampler=Picky(ALWAYS_ON))
    assert not tracer.start_span("remote child", context=parent_context(TP)).is_recording()
    assert asked == ["remote child"]
    # A default ParentBased as the root of one whose remote delegate is not the default.
    nested = ParentBased(root=ParentBased(ALWAYS_ON), remote_parent_sampled=ALWAYS_OFF)
    lean, _ = make(sampler=nested)
    full, _ = sdk(sampler=nested)
    for tracer in (lean, full):
        assert not tracer.start_span("remote child", context=parent_context(TP)).is_recording()


def test_start_as_current_span_takes_the_sdks_arguments() -> None:
    tracer, exporter = make()
    with (
        pytest.raises(RuntimeError),
        tracer.start_as_current_span(
            "quiet", None, SpanKind.CLIENT, record_exception=False, set_status_on_exception=False
        ),
    ):
        raise RuntimeError("x")
    (quiet,) = exporter.get_finished_spans()
    assert (
        quiet.kind is SpanKind.CLIENT and quiet.events == () and quiet.status.status_code is StatusCode.UNSET
    )


class ToolBroke(Exception):
    pass


def test_exceptions_links_and_attribute_order_as_the_sdk_records_them() -> None:
    lean, got = make(span_limits=SpanLimits(max_span_attributes=2))
    full, want = sdk(span_limits=SpanLimits(max_span_attributes=2))
    for tracer in (lean, full):
        span = tracer.start_span("s", attributes={"a": 1, "b": 2})
        span.set_attribute("a", 3)  # set again: now the newest
        span.set_attribute("c", 4)  # so "b" is the one that goes
        span.record_exception(ToolBroke("no"))
        span.add_link(SpanContext(0, 0, False, TraceFlags(0)), {"why": "kept for its attributes"})
        span.end()
    (mine,), (theirs,) = got.get_finished_spans(), want.get_finished_spans()
    assert dict(mine.attributes) == dict(theirs.attributes) == {"a": 3, "c": 4}
    assert mine.events[0].attributes["exception.type"] == theirs.events[0].attributes["exception.type"]
    assert mine.events[0].attributes["exception.type"].endswith("test_spans.ToolBroke")
    assert [dict(link.attributes) for link in mine.links] == [dict(link.attributes) for link in theirs.links]


def test_start_attributes_with_bad_keys_are_dropped_as_the_sdk_drops_them() -> None:
    lean, got = make()
    full, want = sdk()
    for tracer in (lean, full):
        tracer.start_span("s", attributes={"ok": 1, "": 2, 3: "x"}).end()  # type: ignore[dict-item]
    assert dict(got.get_finished_spans()[0].attributes) == dict(want.get_finished_spans()[0].attributes)


def test_an_attribute_set_after_the_end_does_not_reach_the_exported_span() -> None:
    tracer, exporter = make()
    span = tracer.start_span("s", attributes={"a": 1})
    span.end()
    span._attributes["late"] = True  # as a racing set_attribute that passed its check just before end()
    assert dict(exporter.get_finished_spans()[0].attributes) == {"a": 1}


def test_an_oversized_tracestate_is_truncated_as_w3c_says_and_logged_at_no_length(caplog: Any) -> None:
    big = "a=" + "x" * 60_000
    members = [f"k{i}=" + "v" * 40 for i in range(20)]  # 20 x 44 characters: over 512
    header = ",".join([members[0], big, *members[1:]])
    with caplog.at_level("WARNING"):
        state = trace.get_current_span(parent_context(TP, header)).get_span_context().trace_state
    # the 128+ member goes first, then members from the end until the header fits 512 characters
    assert state.to_header() == ",".join(members[:11])
    assert len(state.to_header()) <= 512
    assert all(len(r.getMessage()) < 1_000 for r in caplog.records)
    # a header within bounds is kept as sent
    assert trace.get_current_span(parent_context(TP, "vendor=abc")).get_span_context().trace_state.to_header() == (
        "vendor=abc"
    )
