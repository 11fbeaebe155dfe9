"""``GET /metrics`` of ``serve``: the gateway-wide figures for Prometheus, read from Redis at each scrape.

``serve`` runs no calls itself; the workers add what they ran to ``hermes:stats`` every second
(``workers.telemetry``). Here OpenTelemetry observable instruments read those totals and the live state
(queue depths, calls executing per concurrency key, slot limits, breaker states, live workers), and the
OpenTelemetry Prometheus exporter writes them out, so ``hermes_calls_total`` summed over its series is
the number of calls the workers ran (each attempt that ended, ``retrying`` included, as a worker's own
``hermes.calls`` counts them). OpenTelemetry has no observable histogram, so ``hermes_call_duration_seconds``
(the workers' bucket counts) is a ``prometheus_client`` collector in the same registry.

A worker started with ``--metrics-port`` serves its own process's instruments the same way
(``workers.otelsdk.serve_prometheus``); scrape one or the other for totals, not both.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from hermes_gateway import console_data
from workers.telemetry import BREAKER_STATES, LATENCY_BOUNDS, SEP

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class GatewayMetrics:
    """A meter provider of its own (not the process's global one) whose reader is scraped on demand."""

    def __init__(self, gw: Any) -> None:
        self.gw = gw
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._snap: dict[str, Any] = {}
        reader = PrometheusMetricReader(registry=self.registry)
        resource = Resource.create({"service.name": "hermes-gateway"})
        self.provider = MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)
        meter = self.provider.get_meter("hermes_gateway.serve")
        meter.create_observable_counter(
            "hermes.calls", [self._calls], unit="{call}", description="Calls that ended, over every worker"
        )
        meter.create_observable_gauge(
            "hermes.queue.depth", [self._queues], unit="{call}", description="Calls waiting on each queue"
        )
        meter.create_observable_up_down_counter(
            "hermes.executor.inflight", [self._inflight], unit="{call}", description="Calls executing per key"
        )
        meter.create_observable_gauge(
            "hermes.concurrency.limit", [self._limits], unit="{call}", description="Slots per concurrency key"
        )
        meter.create_observable_gauge(
            "hermes.concurrency.waiting", [self._waiting], unit="{call}", description="Calls waiting for a slot"
        )
        meter.create_observable_gauge(
            "hermes.breaker.state", [self._breakers], description="0 closed, 1 half-open, 2 open"
        )
        meter.create_observable_gauge(
            "hermes.batch.items", [self._batches], unit="{call}",
            description="Items of each batch on record by state: done, failed, cancelled, running, unsent",
        )
        meter.create_observable_gauge(
            "hermes.workers", [self._workers], unit="{worker}", description="Workers with a recent heartbeat"
        )
        meter.create_observable_counter(
            "hermes.llm.tokens", [self._tokens], unit="{token}",
            description="LLM tokens per principal, model and direction (in: prompt, out: completion)",
        )
        meter.create_observable_gauge(
            "hermes.rate.limit", [self._rate_limits], description="Each rate limiter's limit per kind"
        )
        meter.create_observable_gauge(
            "hermes.rate.left", [self._rate_left], description="What each rate limiter has left in its window"
        )
        meter.create_observable_gauge(
            "hermes.rate.waiting", [self._rate_waiting], unit="{call}", description="Calls waiting on each rate-limited key"
        )
        meter.create_observable_gauge(
            "hermes.rate.paused_until", [self._rate_paused], unit="s",
            description="When a provider's pause of the key ends (unix seconds; 0: not paused)",
        )
        self.registry.register(_DurationCollector(self))

    def render(self) -> bytes:
        """The exposition text: one Redis read, then every instrument observes it (blocking: a thread)."""
        conn = self.gw.conn
        stats = console_data.read_stats(conn)
        from broker.breaker import Breakers
        from broker.limits import Limits

        snap = {
            "stats": stats,
            "queues": console_data.queue_depths(conn),
            "inflight": console_data.inflight(conn),
            "limits": Limits(conn).snapshot(),
            "rate_limits": console_data.rate_limits(conn),
            "breakers": Breakers(conn).all(),
            "workers": len(self.gw.live_workers()),
            "batches": console_data.batches(conn, 100),
        }
        with self._lock:  # one scrape at a time: the callbacks read this scrape's snapshot
            self._snap = snap
            return generate_latest(self.registry)

    def close(self) -> None:
        self.provider.shutdown()

    # -- the callbacks (run inside generate_latest) ----------------------------------------------

    def _calls(self, _options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for field, value in self._snap.get("stats", {}).items():
            parts = field.split(SEP)
            if parts[0] == "calls" and len(parts) >= 5:
                attrs = {
                    "hermes.call.kind": parts[1],
                    "hermes.call.name": SEP.join(parts[2:-2]),
                    "hermes.call.state": parts[-2],
                }
                if parts[-1]:
                    attrs["error.type"] = parts[-1]
                out.append(Observation(int(value), attrs))
        return out

    def _tokens(self, _options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for field, value in self._snap.get("stats", {}).items():
            parts = field.split(SEP)
            if parts[0] == "tokens" and len(parts) >= 4 and parts[-1] in ("in", "out"):
                attrs = {"principal": parts[1], "model": SEP.join(parts[2:-1]), "direction": parts[-1]}
                out.append(Observation(int(value), attrs))
        return out

    def _rate_limits(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(v, {"hermes.concurrency_key": r["key"], "hermes.rate.kind": k})
            for r in self._snap.get("rate_limits", []) for k, v in r["limits"].items()
        ]

    def _rate_left(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(v, {"hermes.concurrency_key": r["key"], "hermes.rate.kind": k})
            for r in self._snap.get("rate_limits", []) for k, v in r["left"].items()
        ]

    def _rate_waiting(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(r["waiting"], {"hermes.concurrency_key": r["key"]}) for r in self._snap.get("rate_limits", [])]

    def _rate_paused(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(r["paused_until"] or 0, {"hermes.concurrency_key": r["key"]})
            for r in self._snap.get("rate_limits", [])
        ]

    def _queues(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(d, {"messaging.destination.name": q}) for q, d in self._snap.get("queues", {}).items()]

    def _inflight(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"hermes.concurrency_key": k}) for k, n in self._snap.get("inflight", {}).items()]

    def _limits(self, _options: CallbackOptions) -> Iterable[Observation]:
        rows = self._snap.get("limits", [])
        return [Observation(r["limit"], {"hermes.concurrency_key": r["key"]}) for r in rows if r["limit"] >= 0]

    def _waiting(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(r["waiting"], {"hermes.concurrency_key": r["key"]}) for r in self._snap.get("limits", [])]

    def _breakers(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(BREAKER_STATES.get(b["state"], 0), {"hermes.breaker.key": b["key"]})
            for b in self._snap.get("breakers", [])
        ]

    def _batches(self, _options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for b in self._snap.get("batches", []):
            attrs = {"hermes.batch.id": b["id"], "hermes.call.name": b["tool"]}
            figures = {**b["counts"], "running": b["running"]}
            if b["total"] is not None:
                figures["unsent"] = max(0, b["total"] - b["submitted"])
            out += [Observation(n, {**attrs, "hermes.batch.state": state}) for state, n in figures.items()]
        return out

    def _workers(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._snap.get("workers", 0))]


class _DurationCollector(Collector):
    """``hermes_call_duration_seconds``: the workers' duration bucket counts, per call kind and name."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[HistogramMetricFamily]:
        figures = console_data.call_figures(self.metrics._snap.get("stats", {}))
        family = HistogramMetricFamily(
            "hermes_call_duration_seconds",
            "Time from claim to the terminal state, over every worker",
            labels=["hermes_call_kind", "hermes_call_name"],
            unit="seconds",
        )
        for label, counts in sorted(figures["latency_by_tool"].items()):
            kind, _, name = label.partition(":")
            cumulative, buckets = 0, []
            for bound, n in zip([*LATENCY_BOUNDS, float("inf")], counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([kind, name], buckets, figures["duration_sum"].get(label, 0.0))
        yield family
