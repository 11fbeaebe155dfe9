"""One trace across three processes: the client (in-memory exporter), a real worker and an HTTP back end
(both exporting OTLP/HTTP to a receiver this test runs), with events, audit and log lines on the same ids."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry import baggage
from opentelemetry import context as otel_context
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from broker import events, otel
from broker.audit import AuditLog
from tests.conftest import REPO, wait_until

KEY = "sk-" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
KIND_SERVER, KIND_CONSUMER = 2, 5  # OTLP Span.SpanKind numbers
STATUS_ERROR = 2

# The HTTP back end: its own process, continuing the trace from the traceparent header it receives.
BACKEND = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit
from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

provider = TracerProvider(resource=Resource.create({"service.name": "weather-backend"}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1] + "/v1/traces")))
tracer = provider.get_tracer("backend")

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        ctx = propagate.extract(dict(self.headers.items()))
        with tracer.start_as_current_span("GET /weather", context=ctx, kind=SpanKind.SERVER):
            city = parse_qs(urlsplit(self.path).query).get("city", [""])[0]
            status = 200 if city != "Atlantis" else 404
            body = json.dumps(
                {"city": city, "traceparent": self.headers.get("traceparent"), "baggage": self.headers.get("baggage")}
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

server = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP (protobuf) receiver: keeps every span it is sent, decoded into plain dicts."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def named(self, name: str, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["name"] == name and s["trace_id"] == trace_id]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/v1/traces":
            req = ExportTraceServiceRequest.FromString(body)
            for rs in req.resource_spans:
                service = {a.key: _value(a.value) for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        span = {
                            "service": service,
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(),
                            "kind": s.kind,
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "status": s.status.code,
                            "links": [link.span_id.hex() for link in s.links],
                            "events": [e.name for e in s.events],
                        }
                        with self.server.lock:
                            self.server.spans.append(span)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.shutdown()
    r.server_close()


@pytest.fixture
def backend(receiver: Receiver) -> Iterator[int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", BACKEND, receiver.url], stdout=subprocess.PIPE, cwd=REPO, text=True
    )
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def client_spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.use_providers(tracer_provider=provider)
    yield provider, exporter
    otel.use_providers()


@pytest.fixture
def traced(home: Any, workers: Any, receiver: Receiver, backend: int) -> Any:
    """A weather tool on the back end, and a worker exporting to the receiver with JSON logs at INFO."""
    home.config({"executors": {"http": {"allow_hosts": ["127.0.0.1"]}}})
    home.tool(
        "get_weather",
        "http",
        endpoint=f"http://127.0.0.1:{backend}/weather",
        headers={"X-Api-Key": "{{api_key}}"},
        timeout=10,
        input_schema={
            "type": "object",
            "properties": {"city": {"type": "string"}, "api_key": {"type": "string"}},
            "required": ["city"],
        },
    )
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_SERVICE_NAME": "hermes-worker",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_METRICS_EXPORTER": "none",
        "HERMES_LOG_FORMAT": "json",
        "HERMES_LOG_LEVEL": "INFO",
    }
    (worker,) = workers(1, env=env)
    return worker


def worker_spans(receiver: Receiver, trace_id: str, names: list[str]) -> dict[str, dict[str, Any]]:
    wait_until(lambda: all(receiver.named(n, trace_id) for n in names), timeout=15, message=f"spans {names}")
    return {n: receiver.named(n, trace_id)[0] for n in names}


def log_lines(worker: Any, call_id: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in worker.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("call_id") == call_id]


def test_one_trace_across_client_worker_and_http_back_end(
    gateway: Any, traced: Any, receiver: Receiver, client_spans: Any
) -> None:
    provider, exporter = client_spans
    gateway.sync_tools()
    token = otel_context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with provider.get_tracer("agent").start_as_current_span("agent turn") as turn:
            handle = gateway.call_tool("get_weather", {"city": "Paris", "api_key": KEY}, tool_call_id="tc-1")
    finally:
        otel_context.detach(token)
    result = handle.result(20)
    trace_id = f"{turn.get_span_context().trace_id:032x}"

    # The client: agent turn -> send tools (PRODUCER).
    send = next(s for s in exporter.get_finished_spans() if s.name == "send tools")
    assert send.kind is SpanKind.PRODUCER and send.parent.span_id == turn.get_span_context().span_id
    assert send.attributes["messaging.message.id"] == handle.call_id
    assert send.attributes["messaging.destination.name"] == "tools"
    send_id = f"{send.context.span_id:016x}"
    # (The envelope that carried send's traceparent and the baggage is gone once the call ended: the
    # worker's CONSUMER span below is send's child, and the back end gets the baggage as sent.)

    # The worker: process tools (CONSUMER, child of and linked to send) -> policy, execute_tool.
    got = worker_spans(
        receiver, trace_id, ["process tools", "policy", "execute_tool get_weather", "GET /weather"]
    )
    process, execute, backend_span = (
        got["process tools"],
        got["execute_tool get_weather"],
        got["GET /weather"],
    )
    assert process["service"] == "hermes-worker" and process["kind"] == KIND_CONSUMER
    assert process["parent"] == send_id and process["links"] == [send_id]
    assert got["policy"]["parent"] == process["span_id"]
    assert execute["parent"] == process["span_id"]
    assert execute["attributes"]["gen_ai.tool.name"] == "get_weather"
    assert execute["attributes"]["gen_ai.tool.call.id"] == "tc-1"
    # The back end: its server span's parent is the executor span, from the header the executor sent.
    assert backend_span["service"] == "weather-backend" and backend_span["kind"] == KIND_SERVER
    assert backend_span["parent"] == execute["span_id"]
    assert result["traceparent"].startswith(f"00-{trace_id}-{execute['span_id']}-")
    assert int(result["traceparent"][-2:], 16) & 1  # sampled
    assert result["baggage"] == "tenant=acme"  # the caller's baggage reaches the back end as it was sent

    # Events and the audit record carry the same trace id; worker events the consumer span's id.
    hist = list(handle.events(timeout=5))  # every event, as the caller heard them (Redis keeps the last)
    assert {e.trace_id for e in hist} == {trace_id}
    assert hist[0].span_id == send_id and {e.span_id for e in hist[1:]} == {process["span_id"]}
    record = AuditLog.from_settings(gateway.conn, gateway.settings.audit).get(handle.call_id)
    assert record is not None and record.trace_id == trace_id

    # Log lines: JSON, with call_id, trace_id, span_id and tool bound; at INFO one end line (the start is DEBUG).
    lines = log_lines(traced, handle.call_id)
    assert {(x["trace_id"], x["span_id"], x["tool"]) for x in lines} == {
        (trace_id, process["span_id"], "get_weather")
    }
    started = [x for x in lines if x["event"] == "call started"]
    finished = [x for x in lines if x["event"] == "call finished"]
    assert len(started) == 0 and len(finished) == 1
    assert (
        finished[0]["state"] == "done" and finished[0]["level"] == "info" and finished[0]["duration_ms"] > 0
    )

    # Redaction: the key reached the back end's header, never a span attribute or a log line.
    assert KEY not in json.dumps(receiver.spans) and KEY not in traced.log()
    assert '"api_key": "***"' in execute["attributes"]["gen_ai.tool.call.arguments"]


def test_a_failing_back_end_marks_the_spans_error_and_logs_a_warning(
    gateway: Any, traced: Any, receiver: Receiver, client_spans: Any
) -> None:
    gateway.sync_tools()
    handle = gateway.call_tool("get_weather", {"city": "Atlantis", "api_key": "k"})
    with pytest.raises(Exception, match="404"):
        handle.result(20)
    send = next(s for s in client_spans[1].get_finished_spans() if s.name == "send tools")
    trace_id = f"{send.context.trace_id:032x}"  # no current span: the producer span starts the trace
    got = worker_spans(receiver, trace_id, ["process tools", "execute_tool get_weather"])
    for span in got.values():
        assert span["status"] == STATUS_ERROR and span["attributes"]["error.type"] == "executor_error"
    assert "exception" in got["execute_tool get_weather"]["events"]
    finished = [x for x in log_lines(traced, handle.call_id) if x["event"] == "call finished"]
    assert [(x["level"], x["state"], x["error_type"]) for x in finished] == [
        ("warning", "failed", "executor_error")
    ]


def test_a_call_with_no_incoming_context_starts_a_new_trace(
    gateway: Any, traced: Any, receiver: Receiver
) -> None:
    gateway.sync_tools()
    handles = [gateway.call_tool("get_weather", {"city": c, "api_key": "k"}) for c in ("Oslo", "Lima")]
    for h in handles:
        h.result(20)
    traces = [events.history(gateway.conn, h.call_id)[0].trace_id for h in handles]
    assert len(set(traces)) == 2
    for trace_id in traces:
        got = worker_spans(receiver, trace_id, ["process tools", "GET /weather"])
        assert got["GET /weather"]["trace_id"] == trace_id


class ZipkinReceiver(ThreadingHTTPServer):
    """Zipkin's v2 JSON API (POST /api/v2/spans): keeps every span it is sent."""

    daemon_threads = True

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/api/v2/spans":
                    with receiver.lock:
                        receiver.spans.extend(json.loads(body))
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()

        receiver = self
        super().__init__(("127.0.0.1", 0), Handler)
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


def test_with_otel_traces_exporter_zipkin_the_workers_spans_go_to_zipkin(
    gateway: Any, home: Any, workers: Any
) -> None:
    """The seed: Jaeger or Zipkin take Hermes' traces directly (Jaeger speaks OTLP; Zipkin its JSON API)."""
    zipkin = ZipkinReceiver()
    try:
        home.echo_tool()
        gateway.sync_tools()
        env = {
            "OTEL_TRACES_EXPORTER": "zipkin",
            "OTEL_EXPORTER_ZIPKIN_ENDPOINT": f"http://127.0.0.1:{zipkin.server_address[1]}/api/v2/spans",
            "OTEL_SERVICE_NAME": "hermes-worker",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_METRICS_EXPORTER": "none",
        }
        workers(1, env=env)
        handle = gateway.call_tool("echo", {"text": "hi"})
        handle.result(20)
        trace_id = events.history(gateway.conn, handle.call_id)[-1].trace_id

        def sent() -> list[dict[str, Any]]:
            with zipkin.lock:
                return [s for s in zipkin.spans if s.get("traceId") == trace_id]

        names = {s["name"] for s in wait_until(sent, 15, message="the call's spans at Zipkin")}
        wait_until(lambda: {"process tools", "execute_tool echo"} <= {s["name"] for s in sent()}, 15,
                   message=f"the process and execute spans (got {names})")
        assert {s["localEndpoint"]["serviceName"] for s in sent()} == {"hermes-worker"}
    finally:
        zipkin.shutdown()
        zipkin.server_close()
