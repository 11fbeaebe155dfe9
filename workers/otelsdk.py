"""OpenTelemetry SDK set-up from the standard ``OTEL_*`` environment and ``settings.telemetry``.

Tracing is off (no SDK provider) unless asked for (:func:`trace_mode`); the rest of the ``OTEL_*``
environment is the SDK's own to read. Metrics are exported with OTLP when traces are (unless
``OTEL_METRICS_EXPORTER=none``), to the console only when ``OTEL_METRICS_EXPORTER=console``;
``serve_prometheus`` serves them on ``/metrics`` with tracing on or off.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics, trace

from broker import otel
from broker.config import TRACE_MODES, TelemetrySettings
from broker.errors import ConfigError

MODES = TRACE_MODES

_lock = threading.Lock()
_mode: str | None = None  # what setup() installed in this process
_installed: list[tuple[Any, Any]] = []  # (provider, exporter) pairs setup() made, for shutdown()
_extra_readers: list[Any] = []  # metric readers every meter provider of setup() gets (Prometheus)
EXIT_FLUSH_MS = 1000
MEMORY_KEEP = 2048  # spans HERMES_TRACE=memory keeps: a worker's heap (and GC passes) must not grow per call


def trace_mode(telemetry: TelemetrySettings, environ: Mapping[str, str] | None = None) -> str:
    """The tracing mode asked for, first match wins: ``OTEL_SDK_DISABLED=true``: off; ``HERMES_TRACE``
    (off, console, otlp, zipkin, memory); ``OTEL_TRACES_EXPORTER`` (otlp, zipkin, console, none); an OTLP
    endpoint: otlp."""
    env = os.environ if environ is None else environ  # the SDK's OTEL_* variables, not ours
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return "off"
    if telemetry.trace:
        return telemetry.trace
    exporter = env.get("OTEL_TRACES_EXPORTER", "").split(",")[0].strip().lower()
    if exporter in ("none", "console", "otlp", "zipkin"):
        return "off" if exporter == "none" else exporter
    if exporter:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: only otlp, zipkin, console and none are built in, got {exporter!r}")
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return "otlp"
    return "off"


def setup(service_name: str, telemetry: TelemetrySettings, mode: str | None = None) -> str:
    """Install the SDK tracer and meter providers for this process (once); returns the mode in force."""
    global _mode
    with _lock:
        if _mode is not None:
            return _mode
        mode = mode or trace_mode(telemetry)
        if mode not in MODES:
            raise ConfigError(f"tracing mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "off":
            if _extra_readers:
                metrics.set_meter_provider(_meter_provider(_resource(service_name), _extra_readers, None))
            _mode = mode
            return mode
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        from workers.spans import Provider

        resource = _resource(service_name)
        # Our shutdown() replaces the SDK's exit hook: an unreachable collector cannot hold a process for the
        # exporter's retries. HERMES_LEAN_SPANS=0: the SDK's own tracer.
        kind = Provider if telemetry.lean_spans else TracerProvider
        provider = kind(resource=resource, shutdown_on_exit=False)
        exporter = _span_exporter(mode)
        # Console output is for a quick look: each span as it ends.
        processor = SimpleSpanProcessor(exporter) if mode == "console" else BatchSpanProcessor(exporter)
        provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
        _installed.append((provider, exporter))
        meters = _meter_provider(resource, _extra_readers, _metric_exporter(mode))
        if meters is not None:
            metrics.set_meter_provider(meters)
        atexit.register(shutdown)
        _mode = mode
        return mode


def _resource(service_name: str) -> Any:
    from opentelemetry.sdk.resources import Resource

    # The environment names the service when it says so; our default only fills the gap.
    attributes = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in attributes
    return Resource.create({} if named else {"service.name": service_name})


def _meter_provider(resource: Any, readers: list[Any], exporter: Any) -> Any:
    """A meter provider read by ``readers`` and exporting with ``exporter`` (when any); None with neither."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    if exporter is not None:
        readers = [*readers, PeriodicExportingMetricReader(exporter)]  # OTEL_METRIC_EXPORT_INTERVAL
    if not readers:
        return None
    provider = MeterProvider(resource=resource, metric_readers=list(readers), shutdown_on_exit=False)
    _installed.append((provider, exporter))
    return provider


def serve_prometheus(port: int, host: str = "127.0.0.1", service_name: str = "hermes-worker") -> Any:
    """Serve this process's metrics on ``http://host:port/metrics`` (OpenTelemetry's Prometheus exporter);
    returns the HTTP server. Before ``setup``, the meter provider it installs gets the reader; after it, our
    instruments go to a meter provider of their own with the reader and ``setup``'s metric export."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, start_http_server

    with _lock:
        try:
            server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from e
        reader = PrometheusMetricReader()
        if _mode is None:
            _extra_readers.append(reader)
            return server
        exporter = _metric_exporter(_mode) if _mode != "off" else None
        otel.use_providers(meter_provider=_meter_provider(_resource(service_name), [reader], exporter))
    return server


def shutdown(timeout_ms: int = EXIT_FLUSH_MS) -> None:
    """Flush within ``timeout_ms``, then stop the exporters (aborting their retries) and the providers."""
    pairs = list(_installed)
    _installed.clear()
    for provider, exporter in pairs:
        _bounded(provider.force_flush, timeout_ms)
        if exporter is not None:
            _bounded(exporter.shutdown, 200)  # wakes an export sleeping between retries: it gives up
        _bounded(provider.shutdown, 200)


def _bounded(step: Any, timeout_ms: int) -> None:
    # The SDK's force_flush ignores its timeout and exports in the caller's thread, retrying for up to
    # OTEL_EXPORTER_OTLP_TIMEOUT (10 s): run each step on a daemon thread and stop waiting in time.
    def run() -> None:
        with contextlib.suppress(Exception):  # an unreachable collector must not stop a process from exiting
            step()

    thread = threading.Thread(target=run, name="hermes-otel-flush", daemon=True)
    thread.start()
    thread.join(timeout_ms / 1000)


def _protocol(signal: str) -> str:
    specific = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
    return (specific or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()


def _span_exporter(mode: str) -> Any:
    if mode == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        # stderr: a command's stdout is its result (`x=$(hermes-gateway --trace console tool run ...)`).
        return ConsoleSpanExporter(out=sys.stderr)
    if mode == "memory":
        return _recent_spans_exporter(MEMORY_KEEP)
    if mode == "zipkin":  # Zipkin's v2 JSON API (OTEL_EXPORTER_ZIPKIN_ENDPOINT, default localhost:9411)
        try:
            from opentelemetry.exporter.zipkin.json import ZipkinExporter
        except ImportError:
            raise ConfigError(
                "tracing to Zipkin needs its exporter: pip install 'hermes-gateway[zipkin]' "
                "(opentelemetry-exporter-zipkin-json), or send OTLP to a collector that forwards to Zipkin"
            ) from None
        return ZipkinExporter()
    if _protocol("TRACES") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _recent_spans_exporter(keep: int) -> Any:
    """An exporter that keeps the latest ``keep`` spans (the SDK's in-memory one keeps every span: the heap,
    and the GC's passes over it, would grow per call)."""
    from collections import deque

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class RecentSpans(SpanExporter):
        def __init__(self) -> None:
            self._spans: deque[Any] = deque(maxlen=keep)

        def export(self, spans: Any) -> SpanExportResult:
            self._spans.extend(spans)  # deque appends are thread-safe
            return SpanExportResult.SUCCESS

        def get_finished_spans(self) -> tuple[Any, ...]:
            return tuple(self._spans)

        def clear(self) -> None:
            self._spans.clear()

    return RecentSpans()


def _metric_exporter(mode: str) -> Any:
    wanted = os.environ.get("OTEL_METRICS_EXPORTER", "").split(",")[0].strip().lower()
    if wanted == "none" or (not wanted and mode != "otlp"):
        return None
    if wanted == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()
    if _protocol("METRICS") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter()
