"""Call figures: OpenTelemetry metrics when a meter provider is set, and totals in Redis for ``status --watch``.

Instruments (attributes in brackets):

- ``hermes.calls`` counter [hermes.call.kind, hermes.call.name, hermes.call.state, error.type]
- ``hermes.call.duration`` histogram, s [hermes.call.kind, hermes.call.name, hermes.call.state]
- ``hermes.call.queue_wait`` histogram, s: claim time − submission [messaging.destination.name]
- ``hermes.executor.inflight`` up-down counter [hermes.concurrency_key]
- ``hermes.breaker.state_changes`` counter [hermes.breaker.key, hermes.breaker.state]
- ``hermes.breaker.state`` observable gauge, 0 closed / 1 half-open / 2 open [hermes.breaker.key]
- ``hermes.queue.depth`` observable gauge: calls waiting on each RQ queue [messaging.destination.name]

The same figures are summed per process and added to the ``hermes:stats`` hash once a second (one
pipeline, only when something changed), with each worker's in-flight calls per key beside it, so the
terminal view reads them from Redis like ``status`` does. Durations are also counted in fixed buckets
(``lat|<kind>|<name>|<bucket>``, upper bounds ``LATENCY_BOUNDS``): the console's p50/p99 and the
gateway-wide ``hermes.call.duration`` histogram of ``serve``'s ``/metrics`` come from them.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import redis

from broker import keys, otel
from workers.hooks import Hook, Writer

if TYPE_CHECKING:
    from workers.runner import Running


BREAKER_STATES = {"closed": 0, "half_open": 1, "half-open": 1, "open": 2}
FLUSH_INTERVAL = 1.0
SEP = "|"
# Upper bounds (seconds, inclusive, as Prometheus' ``le``) of the duration buckets kept in hermes:stats;
# the last bucket (index len(LATENCY_BOUNDS)) holds everything slower.
LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def latency_bucket(seconds: float) -> int:
    """The index of the bucket a duration falls in (``le`` semantics: 0.001 is in bucket 0)."""
    return bisect_left(LATENCY_BOUNDS, seconds)


class _Instruments:
    """The instruments of one meter (made once per meter provider)."""

    def __init__(self, meter: Any) -> None:
        self.calls = meter.create_counter("hermes.calls", unit="{call}", description="Calls that ended")
        self.duration = meter.create_histogram(
            "hermes.call.duration", unit="s", description="Time from claim to the terminal state"
        )
        self.queue_wait = meter.create_histogram(
            "hermes.call.queue_wait", unit="s", description="Time a call waited on its queue"
        )
        self.inflight = meter.create_up_down_counter(
            "hermes.executor.inflight", unit="{call}", description="Calls running, per concurrency key"
        )
        self.breaker_changes = meter.create_counter(
            "hermes.breaker.state_changes", unit="{change}", description="Circuit breaker state changes"
        )
        meter.create_observable_gauge(
            "hermes.breaker.state", callbacks=[_observe_breakers], description="0 closed, 1 half-open, 2 open"
        )
        meter.create_observable_gauge(
            "hermes.queue.depth", unit="{call}", callbacks=[_observe_queues], description="Calls waiting"
        )


_cache: tuple[Any, _Instruments] | None = None
_cache_lock = threading.Lock()


def _instruments() -> _Instruments | None:
    global _cache
    meter = otel.meter()
    if meter is None:
        return None
    cached = _cache
    if cached is not None and cached[0] is meter:
        return cached[1]
    with _cache_lock:
        if _cache is None or _cache[0] is not meter:
            _cache = (meter, _Instruments(meter))
        return _cache[1]


# -- process-wide totals -----------------------------------------------------------------------


class _Totals:
    """What this process adds to ``hermes:stats`` at the next flush."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.sums: dict[str, float] = {}
        self.breakers: dict[str, str] = {}  # current state per key (also read by the gauge)
        self.breakers_dirty: set[str] = set()

    def add(self, count_fields: Iterable[str], sums: Iterable[tuple[str, float]]) -> None:
        with self.lock:
            counts, totals = self.counts, self.sums
            for f in count_fields:
                counts[f] = counts.get(f, 0) + 1
            for f, v in sums:
                totals[f] = totals.get(f, 0.0) + v

    def add_n(self, counts: Iterable[tuple[str, int]]) -> None:
        with self.lock:
            for f, n in counts:
                self.counts[f] = self.counts.get(f, 0) + n

    def take(self) -> tuple[dict[str, int], dict[str, float], dict[str, str]]:
        with self.lock:
            counts, sums = self.counts, self.sums
            breakers = {k: self.breakers[k] for k in self.breakers_dirty}
            self.counts, self.sums, self.breakers_dirty = {}, {}, set()
        return counts, sums, breakers


_totals = _Totals()
_queue_conns: list[redis.Redis] = []


def call_started(ckey: str, queue: str, wait_s: float) -> None:
    """A worker began a call that waited ``wait_s`` seconds on ``queue``."""
    _totals.add((f"wait_n{SEP}{queue}",), ((f"wait{SEP}{queue}", wait_s),))
    inst = _instruments()
    if inst is not None:
        inst.inflight.add(1, {"hermes.concurrency_key": ckey})
        inst.queue_wait.record(wait_s, {"messaging.destination.name": queue})


def call_ended(
    ckey: str,
    kind: str,
    name: str,
    state: str,
    error_type: str | None,
    duration_s: float,
    inflight: bool = True,
) -> None:
    """A call this worker ran reached a terminal state (or was handed back); ``inflight``: it was counted."""
    label = f"{kind}{SEP}{name}"
    _totals.add(
        (
            f"calls{SEP}{label}{SEP}{state}{SEP}{error_type or ''}",
            f"duration_n{SEP}{label}",
            f"lat{SEP}{label}{SEP}{bisect_left(LATENCY_BOUNDS, duration_s)}",
        ),
        ((f"duration{SEP}{label}", duration_s),),
    )
    inst = _instruments()
    if inst is not None:
        if inflight:
            inst.inflight.add(-1, {"hermes.concurrency_key": ckey})
        attrs = {"hermes.call.kind": kind, "hermes.call.name": name, "hermes.call.state": state}
        inst.duration.record(duration_s, attrs)
        if error_type:
            attrs = {**attrs, "error.type": error_type}
        inst.calls.add(1, attrs)


def usage(principal: str | None, kind: str, name: str, tokens_in: int = 0, tokens_out: int = 0) -> None:
    """A call of ``principal`` ended: one call of ``kind:name``, and an LLM call's tokens in and out (the
    fields ``pcalls|<principal>|<kind>|<name>`` and ``tokens|<principal>|<model>|in`` / ``out``)."""
    who = principal or "-"
    counts = [(f"pcalls{SEP}{who}{SEP}{kind}{SEP}{name}", 1)]
    if tokens_in or tokens_out:
        counts += [(f"tokens{SEP}{who}{SEP}{name}{SEP}in", tokens_in), (f"tokens{SEP}{who}{SEP}{name}{SEP}out", tokens_out)]
    _totals.add_n(counts)


def breaker_changed(key: str, old: str, new: str) -> None:
    """A circuit breaker moved from ``old`` to ``new`` (closed | half_open | open): call on each change."""
    with _totals.lock:
        _totals.breakers[key] = new
        _totals.breakers_dirty.add(key)
        _totals.counts[f"breaker_changes{SEP}{key}"] = _totals.counts.get(f"breaker_changes{SEP}{key}", 0) + 1
    inst = _instruments()
    if inst is not None:
        inst.breaker_changes.add(
            1, {"hermes.breaker.key": key, "hermes.breaker.state": new, "hermes.breaker.from": old}
        )


def watch_queues(conn: redis.Redis) -> None:
    """Let the queue-depth gauge read the RQ queues through ``conn`` (the latest worker core's)."""
    _queue_conns[:] = [conn]
    _instruments()  # create the gauges now, so a reader sees them before the first call


def _observe_breakers(_options: Any) -> Iterable[Any]:
    from opentelemetry.metrics import Observation

    with _totals.lock:
        current = dict(_totals.breakers)
    return [Observation(BREAKER_STATES.get(s, 0), {"hermes.breaker.key": k}) for k, s in current.items()]


def _observe_queues(_options: Any) -> Iterable[Any]:
    from opentelemetry.metrics import Observation

    if not _queue_conns:
        return []
    try:
        return [
            Observation(depth, {"messaging.destination.name": q})
            for q, depth in queue_depths(_queue_conns[0])
        ]
    except redis.RedisError:
        return []


def text(value: bytes | str) -> str:
    """A Redis reply as text (clients may or may not decode responses)."""
    return value.decode() if isinstance(value, bytes) else value


def queue_depths(conn: redis.Redis) -> list[tuple[str, int]]:
    """``(queue, calls waiting)`` for every RQ queue, in one round trip after the queue list."""
    names = sorted(text(k) for k in conn.smembers(keys.RQ_QUEUES))
    pipe = conn.pipeline(transaction=False)
    for k in names:
        pipe.llen(k)
    return [(keys.queue_name(k), int(d)) for k, d in zip(names, pipe.execute(), strict=True)]


# -- writing the totals to Redis ---------------------------------------------------------------


def flush(pipe: Any) -> bool:
    """Add what this process counted since the last flush to ``hermes:stats``; False when nothing had changed."""
    counts, sums, breakers = _totals.take()
    for f, n in counts.items():
        pipe.hincrby(keys.STATS, f, n)
    for f, v in sums.items():
        pipe.hincrbyfloat(keys.STATS, f, v)
    if breakers:
        pipe.hset(keys.STATS, mapping={f"breaker{SEP}{k}": s for k, s in breakers.items()})
    return bool(counts or sums or breakers)


class StatsFlusher:
    """A daemon thread that flushes the totals and this worker's in-flight calls per key every second."""

    def __init__(self, conn: redis.Redis, worker: str, inflight: Callable[[], dict[str, int]]) -> None:
        self.conn = conn
        self.key = keys.stats_inflight(worker)
        self.inflight = inflight
        self._stop = threading.Event()
        self._had_inflight = False
        self._thread = threading.Thread(target=self._loop, name="hermes-stats", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL):
            self.flush_now()

    def flush_now(self) -> None:
        pipe = self.conn.pipeline(transaction=False)
        wrote = flush(pipe)
        current = self.inflight()
        if current:
            pipe.delete(self.key)
            pipe.hset(self.key, mapping=cast(Any, current))
            pipe.expire(self.key, int(FLUSH_INTERVAL * 5) + 1)
        elif self._had_inflight:
            pipe.delete(self.key)
        self._had_inflight = bool(current)
        if wrote or len(pipe):
            try:
                pipe.execute()
            except redis.RedisError:
                pass  # figures are best effort; the next flush carries on from zero

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.flush_now()


# -- the hooks: a call's metrics, and its token usage ------------------------------------------------
# Metrics of a call: queue wait and in-flight count when it begins, outcome and duration when it ends.

class CallMetrics(Hook):
    def before_call(self, run: Running) -> None:
        call_started(run.info.ckey, run.info.queue, run.queue_wait)

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None:
        info = run.info
        err_type = str(error.get("type") or "error") if error else None
        # An undecodable payload never started (claimed_at 0), so it was never counted in flight.
        call_ended(info.ckey, info.kind, info.name, outcome, err_type, duration, bool(run.claimed_at))


# A call's token usage: counted for the stats flush, and an LLM call's tokens added to its principal's
# daily total (what ``policy``'s ``daily_tokens`` budget reads) in the terminal move's pipeline.

DAY_TTL = 2 * 86400


class Usage(Hook):
    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        principal = run.env.context.get("principal") if run.env is not None else None
        tokens = run.usage or {"in": 0, "out": 0}
        usage(principal, run.info.kind, run.info.name, tokens["in"], tokens["out"])
        if not principal or run.usage is None:
            return None
        key = keys.usage_day(time.strftime("%Y-%m-%d", time.gmtime()), str(principal))
        total = tokens["in"] + tokens["out"]

        def write(pipe: Any) -> None:
            pipe.incrby(key, total)
            pipe.expire(key, DAY_TTL)

        return write
