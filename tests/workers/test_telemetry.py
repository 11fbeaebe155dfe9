"""A worker's spans and metrics in-process on fakeredis, read back from in-memory exporters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from broker import keys, otel
from broker.calls import Calls
from broker.config import Settings, WorkerSettings, load_settings
from broker.directory import Directory
from broker.envelope import Envelope, Options
from broker.errors import ProviderError
from tests.conftest import heard
from workers import otelsdk
from workers import spans as spans_mod
from workers import telemetry as metrics
from workers.runner import CallRunner, WorkerCore
from workers.specs import check_spec
from workers.telemetry import NO_TRACE, CallTrace, record_usage

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TP = f"00-{TRACE}-{PARENT}-01"
KEY = "sk-" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
TOOLS = [
    {"name": "echo", "executor": "python", "function": "workers.executors.builtin:echo", "timeout": 5},
    {
        "name": "login",
        "executor": "python",
        "function": "workers.executors.builtin:echo",
        "timeout": 5,
        "sensitive": ["pin"],
    },
    {
        "name": "seen",
        "executor": "python",
        "function": "tests.workers.test_telemetry:seen_traceparent",
        "timeout": 5,
    },
    {
        "name": "strict",
        "executor": "python",
        "function": "workers.executors.builtin:echo",
        "timeout": 5,
        "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    },
    {
        "name": "flaky",
        "executor": "python",
        "function": "workers.executors.builtin:echo",
        "timeout": 5,
        "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
        "retry": {"max": 2, "backoff": 0.01, "on": ["invalid_args"]},
    },
]


def seen_traceparent(ctx: Any) -> dict[str, Any]:
    """The traceparent the executor was given (what it would forward) and the baggage in force."""
    from opentelemetry import baggage

    return {"traceparent": str(ctx.traceparent), "baggage": dict(baggage.get_all())}


@pytest.fixture(params=["sdk", "lean"])
def spans(request: pytest.FixtureRequest) -> Iterator[InMemorySpanExporter]:
    # Every span assertion holds for the SDK's tracer (a provider a host application set) and for the lean
    # tracer a worker uses with the provider otelsdk.setup() installs.
    exporter = InMemorySpanExporter()
    provider = TracerProvider() if request.param == "sdk" else spans_mod.Provider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.use_providers(tracer_provider=provider)
    assert isinstance(otel.tracer(), spans_mod.LeanTracer) is (request.param == "lean")
    yield exporter
    otel.use_providers()


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    metric_reader = InMemoryMetricReader()
    otel.use_providers(meter_provider=MeterProvider(metric_readers=[metric_reader]))
    yield metric_reader
    otel.use_providers()


@pytest.fixture
def core(fake: Any, tmp_path: Path) -> Iterator[WorkerCore]:
    for spec in TOOLS:
        Directory(fake).register(check_spec(spec))
    c = WorkerCore(fake, Settings(home=tmp_path, workers=WorkerSettings(lease=5.0, result_ttl=600)), "w-tel")
    yield c
    c.close()


def submit(fake: Any, call_id: str, tool: str = "echo", tp: str = TP, attempts: int = 1, **args: Any) -> None:
    heard(fake)  # (listening as the caller does: an ended call's history is its last event alone)
    env = Envelope(
        call_id=call_id,
        kind="tool",
        tool=tool,
        args=args,
        traceparent=tp,
        baggage="tenant=acme",
        channel="hermes:ch:t",
        context={"session_id": "s", "tool_call_id": f"tc-{call_id}"},
        options=Options(max_attempts=attempts),
    )
    ckey = f"tool:{tool}"
    Calls.check_submit(
        Calls(fake).submit(env, ckey=ckey, queue_size=-1, max_attempts=attempts, timeout=30), ckey, -1
    )


def run_all(core: WorkerCore) -> None:
    runner = CallRunner(core)
    for c in core.calls.claim(["tools"], 100, core.name, core.settings.workers.lease):
        runner.run(c)
    assert core.outbox.flush(5)


def by_name(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {s.name: s for s in exporter.get_finished_spans()}


# -- spans -------------------------------------------------------------------------------------


def test_a_call_continues_the_callers_trace_as_process_span_with_policy_and_executor_children(
    fake: Any, core: WorkerCore, spans: InMemorySpanExporter
) -> None:
    submit(fake, "c1", city="Paris")
    run_all(core)
    found = by_name(spans)
    process, policy, execute = found["process tools"], found["policy"], found["execute_tool echo"]
    assert {s.context.trace_id for s in found.values()} == {int(TRACE, 16)}
    assert process.kind is SpanKind.CONSUMER
    assert process.parent.span_id == int(PARENT, 16)
    assert [link.context.span_id for link in process.links] == [int(PARENT, 16)]
    attrs = process.attributes
    assert attrs["messaging.system"] == "rq" and attrs["messaging.operation.type"] == "process"
    assert attrs["messaging.destination.name"] == "tools" and attrs["messaging.message.id"] == "c1"
    assert attrs["hermes.call.state"] == "done" and attrs["hermes.queue.wait_ms"] >= 0
    assert policy.parent.span_id == process.context.span_id
    assert execute.parent.span_id == process.context.span_id
    assert execute.attributes["gen_ai.operation.name"] == "execute_tool"
    assert execute.attributes["gen_ai.tool.name"] == "echo"
    assert execute.attributes["gen_ai.tool.call.id"] == "tc-c1"
    assert process.status.status_code is StatusCode.UNSET
    # Events carry the trace id and the consumer span's id, so an event leads straight to its span.
    worker_events = heard(fake).events("c1")[1:]
    assert {(e.trace_id, e.span_id) for e in worker_events} == {(TRACE, f"{process.context.span_id:016x}")}
    assert core.audit.get("c1").trace_id == TRACE


def test_the_executor_is_given_its_own_spans_context_and_the_callers_baggage(
    fake: Any, core: WorkerCore, spans: InMemorySpanExporter
) -> None:
    submit(fake, "c1", tool="seen")
    run_all(core)
    execute = by_name(spans)["execute_tool seen"]
    seen = core.calls.record("c1")["result"]
    assert seen["traceparent"] == f"00-{TRACE}-{execute.context.span_id:016x}-01"
    assert seen["baggage"] == {"tenant": "acme"}  # the caller's W3C baggage, from the envelope


def test_a_call_with_a_new_trace_id_starts_its_own_trace(
    fake: Any, core: WorkerCore, spans: InMemorySpanExporter
) -> None:
    other = "0af7651916cd43dd8448eb211c80319c"
    submit(fake, "c1", tp=f"00-{other}-b7ad6b7169203331-01")
    run_all(core)
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {int(other, 16)}


def test_a_refused_call_marks_policy_and_process_spans_error_with_error_type(
    fake: Any, core: WorkerCore, spans: InMemorySpanExporter
) -> None:
    submit(fake, "c1", tool="strict", n="not a number")
    run_all(core)
    found = by_name(spans)
    for name in ("policy", "process tools"):
        assert found[name].status.status_code is StatusCode.ERROR
        assert found[name].attributes["error.type"] == "invalid_args"
    assert "execute_tool strict" not in found
    assert found["process tools"].attributes["hermes.call.state"] == "failed"


def test_a_retried_attempt_ends_its_span_retrying_with_a_retry_event(
    fake: Any, core: WorkerCore, spans: InMemorySpanExporter, reader: InMemoryMetricReader
) -> None:
    submit(fake, "c1", tool="flaky", attempts=3, n="x")
    run_all(core)
    process = by_name(spans)["process tools"]
    assert process.attributes["hermes.call.state"] == "retrying"
    (event,) = [e for e in process.events if e.name == "retry"]
    assert event.attributes["error.type"] == "invalid_args" and event.attributes["hermes.attempt"] == 1
    states = [(p.attributes["hermes.call.state"], p.value) for p in points(reader)["hermes.calls"]]
    assert states == [("retrying", 1)]


def test_secrets_and_sensitive_args_never_reach_span_attributes(
    fake: Any, core: WorkerCore, spans: InMemorySpanExporter
) -> None:
    submit(fake, "c1", tool="login", api_key=KEY, pin="4242", note=f"header Authorization: Bearer {KEY}")
    run_all(core)
    dumped = repr([(s.attributes, s.events, s.status.description) for s in spans.get_finished_spans()])
    assert KEY not in dumped and "4242" not in dumped
    args = by_name(spans)["execute_tool login"].attributes["gen_ai.tool.call.arguments"]
    assert '"api_key": "***"' in args and '"pin": "***"' in args


def test_tracing_off_means_no_trace_object_and_events_still_get_a_span_id(
    fake: Any, core: WorkerCore
) -> None:
    otel.use_providers()
    env = Envelope(call_id="x", kind="tool", tool="echo", traceparent=TP)
    assert otel.tracer() is None and CallTrace.start(env, 1) is NO_TRACE
    submit(fake, "c1")
    run_all(core)
    spans_ids = {e.span_id for e in heard(fake).events("c1")[1:]}
    assert len(spans_ids) == 1 and PARENT not in spans_ids


def test_provider_usage_and_retries_land_on_spans(spans: InMemorySpanExporter) -> None:
    env = Envelope(call_id="l1", kind="llm", request={"model": "m"}, traceparent=TP, queue="llm")
    trace = CallTrace.start(env, 1)

    class Ctx:
        attempt = 2
        traceparent = None

    ctx = Ctx()
    with pytest.raises(ProviderError):
        with trace.provider("m", "openai-compatible", ctx):
            raise ProviderError(f"503 from upstream, key {KEY}", status=503)
    trace.retry(1, 0.25, ProviderError("503", status=503))
    with trace.provider("m", "openai-compatible", ctx) as span:
        record_usage(
            span,
            {
                "model": "m-1",
                "usage": {"prompt_tokens": 12, "completion_tokens": 5},
                "choices": [{"finish_reason": "stop"}],
            },
        )
    trace.end("done")
    trace.finish()
    chats = [s for s in spans.get_finished_spans() if s.name == "chat m"]
    assert [s.status.status_code for s in chats] == [StatusCode.ERROR, StatusCode.UNSET]
    assert chats[0].attributes["error.type"] == "provider_error" and KEY not in chats[0].status.description
    assert chats[1].attributes["gen_ai.usage.input_tokens"] == 12
    assert chats[1].attributes["gen_ai.usage.output_tokens"] == 5
    assert chats[1].attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert ctx.traceparent == f"00-{TRACE}-{chats[1].context.span_id:016x}-01"
    process = by_name(spans)["process llm"]
    retry = [e for e in process.events if e.name == "retry"]
    assert len(retry) == 1 and retry[0].attributes["hermes.retry.delay_s"] == 0.25


# -- metrics -----------------------------------------------------------------------------------


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def test_metrics_after_a_known_workload(fake: Any, core: WorkerCore, reader: InMemoryMetricReader) -> None:
    metrics.watch_queues(fake)
    for i in range(3):
        submit(fake, f"ok{i}", n=i)
    submit(fake, "bad", tool="strict", n="x")
    run_all(core)
    submit(fake, "queued")  # left waiting: the queue-depth gauge sees it
    metrics.breaker_changed("tool:echo", "closed", "open")
    got = points(reader)
    calls = {
        (
            p.attributes["hermes.call.name"],
            p.attributes["hermes.call.state"],
            p.attributes.get("error.type"),
        ): p.value
        for p in got["hermes.calls"]
    }
    assert calls == {("echo", "done", None): 3, ("strict", "failed", "invalid_args"): 1}
    assert sum(p.count for p in got["hermes.call.duration"]) == 3  # (not the refused one: it never ran)
    assert sum(p.count for p in got["hermes.call.queue_wait"]) == 4
    assert {p.attributes["hermes.concurrency_key"]: p.value for p in got["hermes.executor.inflight"]} == {
        "tool:echo": 0,
        "tool:strict": 0,
    }
    assert [(p.attributes["hermes.breaker.key"], p.value) for p in got["hermes.breaker.state"]] == [
        ("tool:echo", 2)
    ]
    assert [p.value for p in got["hermes.breaker.state_changes"]] == [1]
    depth = {p.attributes["messaging.destination.name"]: p.value for p in got["hermes.queue.depth"]}
    assert depth == {"tools": 1}


def test_totals_reach_redis_for_the_status_view(fake: Any, core: WorkerCore) -> None:
    core.stats.flush_now()  # whatever earlier tests in this process counted
    fake.delete(keys.STATS)
    submit(fake, "ok", n=1)
    submit(fake, "bad", tool="strict", n="x")
    run_all(core)
    metrics.breaker_changed("tool:strict", "closed", "open")
    core.stats.flush_now()
    stats = {k.decode(): v.decode() for k, v in fake.hgetall(keys.STATS).items()}
    assert stats["calls|tool|echo|done|"] == "1"
    assert stats["calls|tool|strict|failed|invalid_args"] == "1"
    assert stats["duration_n|tool|echo"] == "1" and float(stats["duration|tool|echo"]) > 0
    assert stats["wait_n|tools"] == "2" and stats["breaker|tool:strict"] == "open"
    parsed = metrics.read_stats(fake)  # what the views read back
    assert parsed.calls[("tool", "strict", "failed", "invalid_args")] == 1 and parsed.waits["tools"].n == 2
    assert parsed.durations[("tool", "echo")].n == 1 and parsed.breakers == {"tool:strict": "open"}


def test_parse_stats_keeps_the_hash_order_and_skips_what_it_cannot_read() -> None:
    got = metrics.parse_stats({
        "duration|tool|a|b": "0.5", "calls|tool|z|done|": "2", "calls|tool|a|b|failed|boom": "1",
        "lat|tool|a|b|3": "4", "lat|tool|a|b|99": "1", "lat|tool|a|b|x": "1", "calls|x|y|z": "1",
        "tokens|p|m|up": "1", "tokens|p|m|x|in": "3", "wait|q": "0.3", "wait_n|q": "2", "pcalls|p|t|z": "?",
    })
    assert list(got.names) == [("tool", "a|b"), ("tool", "z")]  # (the order `status --json` lists calls in)
    assert got.calls == {("tool", "z", "done", ""): 2, ("tool", "a|b", "failed", "boom"): 1}
    assert got.latency == {("tool", "a|b"): [0, 0, 0, 4] + [0] * (len(metrics.LATENCY_BOUNDS) - 3)}
    assert got.tokens == {("p", "m|x", "in"): 3} and got.pcalls == {}
    assert got.waits["q"].mean == pytest.approx(0.15)
    assert got.durations == {("tool", "a|b"): metrics.Timing(0.5)}


# -- turning it on -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "mode"),
    [
        ({}, "off"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "zipkin"),
        ({"HERMES_TRACE": "zipkin"}, "zipkin"),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "off"),
        ({"HERMES_TRACE": "memory", "OTEL_TRACES_EXPORTER": "console"}, "memory"),
        ({"HERMES_TRACE": "off", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "off"),
        ({"OTEL_SDK_DISABLED": "true", "HERMES_TRACE": "console"}, "off"),
    ],
)
def test_the_environment_decides_whether_tracing_is_on(environ: dict[str, str], mode: str, tmp_path: Path) -> None:
    telemetry = load_settings(tmp_path, environ=environ).telemetry  # HERMES_TRACE, as a worker reads it
    assert otelsdk.trace_mode(telemetry, environ) == mode


def test_an_unknown_tracing_mode_is_a_config_error(tmp_path: Path) -> None:
    from broker.errors import ConfigError

    with pytest.raises(ConfigError, match="HERMES_TRACE"):
        load_settings(tmp_path, environ={"HERMES_TRACE": "jaeger"})
    telemetry = load_settings(tmp_path, environ={}).telemetry
    with pytest.raises(ConfigError, match="only otlp, zipkin, console and none are built in, got 'jaeger'"):
        otelsdk.trace_mode(telemetry, {"OTEL_TRACES_EXPORTER": "jaeger"})


def test_a_label_a_caller_picks_is_capped_but_a_tool_name_is_shown_as_it_is(fake: Any) -> None:
    labels = metrics._Labels()
    labels.conn = fake
    fake.sadd(keys.stats_names("llm"), *(f"m{i}" for i in range(keys.STATS_MAX_NAMES)))
    fake.sadd(keys.stats_names("tool"), *(f"t{i}" for i in range(keys.STATS_MAX_NAMES)))
    assert labels("llm", "m1") == "m1"  # admitted before the set filled
    assert labels("llm", "invented") == keys.STATS_OTHER
    fake.delete(keys.stats_names("llm"))  # (a refused value is remembered: no round trip a call for it)
    assert labels("llm", "invented") == keys.STATS_OTHER and labels("llm", "new") == "new"
    assert labels("tool", "tool_number_501") == "tool_number_501"  # (only who manages tools makes one)
