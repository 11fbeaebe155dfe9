"""``GET /metrics`` of ``serve``: the gateway-wide figures for Prometheus, read from Redis at each scrape
(the totals the workers add to ``hermes:stats``, and the live state) by observable OpenTelemetry
instruments; ``hermes_call_duration_seconds`` is a ``prometheus_client`` collector in the same registry
(OpenTelemetry has no observable histogram). Scrape this or the workers' ``--metrics-port``, not both.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from broker.breaker import Breakers
from hermes_gateway import console_data
from workers.telemetry import BREAKER_STATES, LATENCY_BOUNDS, Stats, queue_depths, read_inflight, read_stats

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
        counter, gauge = meter.create_observable_counter, meter.create_observable_gauge
        instruments: list[tuple[Any, str, Any, str, str]] = [
            (counter, "hermes.calls", self._calls, "{call}", "Calls that ended, over every worker"),
            (gauge, "hermes.queue.depth", partial(self._by, "queues", "messaging.destination.name"), "{call}",
             "Calls queued with a slot for a worker to take (waiting for a slot: hermes_concurrency_waiting)"),
            (meter.create_observable_up_down_counter, "hermes.executor.inflight",
             partial(self._by, "inflight", "hermes.concurrency_key"), "{call}", "Calls executing per key"),
            (gauge, "hermes.concurrency.limit", self._limits, "{call}", "Slots per concurrency key"),
            (gauge, "hermes.concurrency.waiting", partial(self._per_key, "limits", "waiting"), "{call}",
             "Calls waiting for a slot"),
            (gauge, "hermes.breaker.state", self._breakers, "", "0 closed, 1 half-open, 2 open"),
            (gauge, "hermes.batch.items", self._batches, "{call}",
             "Items of each batch on record by state: done, failed, cancelled, running, unsent"),
            (gauge, "hermes.workers", self._workers, "{worker}", "Workers with a recent heartbeat"),
            (counter, "hermes.llm.tokens", self._tokens, "{token}",
             "LLM tokens per principal, model and direction (in: prompt, out: completion)"),
            (gauge, "hermes.rate.limit", partial(self._rate, "limits"), "",
             "Each rate limiter's limit per kind"),
            (gauge, "hermes.rate.left", partial(self._rate, "left"), "",
             "What each rate limiter has left in its window"),
            (gauge, "hermes.rate.waiting", partial(self._per_key, "rate_limits", "waiting"), "{call}",
             "Calls waiting on each rate-limited key"),
            (gauge, "hermes.rate.paused_until", partial(self._per_key, "rate_limits", "paused_until"), "s",
             "When a provider's pause of the key ends (unix seconds; 0: not paused)"),
        ]
        for create, name, callback, unit, description in instruments:
            create(name, [callback], unit=unit, description=description)
        self.registry.register(_DurationCollector(self))

    def render(self) -> bytes:
        """The exposition text: one Redis read, then every instrument observes it (blocking: a thread)."""
        conn = self.gw.conn
        inflight = read_inflight(conn)
        snap = {
            "stats": read_stats(conn),
            "queues": dict(queue_depths(conn)),
            "inflight": inflight,
            # (every tool of the directory, idle ones too, as the console shows them)
            "limits": console_data.slots(conn, self.gw.settings, self.gw.directory.all(), running=inflight),
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

    def _calls(self, _options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for (kind, name, state, etype), n in self._stats().calls.items():
            attrs = {"hermes.call.kind": kind, "hermes.call.name": name, "hermes.call.state": state}
            out.append(Observation(n, {**attrs, "error.type": etype} if etype else attrs))
        return out

    def _tokens(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(n, {"principal": principal, "model": model, "direction": way})
            for (principal, model, way), n in self._stats().tokens.items()
        ]

    def _stats(self) -> Stats:
        return self._snap.get("stats") or Stats()

    def _rate(self, field: str, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(v, {"hermes.concurrency_key": r["key"], "hermes.rate.kind": k})
            for r in self._snap.get("rate_limits", []) for k, v in r[field].items()
        ]

    def _per_key(self, rows: str, field: str, _options: CallbackOptions) -> Iterable[Observation]:
        """``field`` of each row of ``rows`` (a missing figure as 0), per concurrency key."""
        rows_now = self._snap.get(rows, [])
        return [Observation(r[field] or 0, {"hermes.concurrency_key": r["key"]}) for r in rows_now]

    def _by(self, figures: str, attribute: str, _options: CallbackOptions) -> Iterable[Observation]:
        """Each figure of the mapping ``figures``, its key as ``attribute``."""
        return [Observation(n, {attribute: key}) for key, n in self._snap.get(figures, {}).items()]

    def _limits(self, _options: CallbackOptions) -> Iterable[Observation]:
        rows = self._snap.get("limits", [])
        return [Observation(r["limit"], {"hermes.concurrency_key": r["key"]}) for r in rows if r["limit"] >= 0]

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
        stats = self.metrics._stats()
        family = HistogramMetricFamily(
            "hermes_call_duration_seconds",
            "Time from claim to the terminal state, over every worker",
            labels=["hermes_call_kind", "hermes_call_name"],
            unit="seconds",
        )
        for (kind, name), counts in sorted(stats.latency.items()):
            cumulative, buckets = 0, []
            for bound, n in zip([*LATENCY_BOUNDS, float("inf")], counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            timing = stats.durations.get((kind, name))
            family.add_metric([kind, name], buckets, timing.seconds if timing else 0.0)
        yield family
