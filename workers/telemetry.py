"""A call's telemetry in a worker: its spans (OpenTelemetry messaging and GenAI conventions), its figures.

``process <queue>`` continues the caller's trace; under it: ``tool_request``, ``policy``, ``tool_execution``
(the middleware phases), ``execute_tool <tool>`` and ``chat <model>``. Strings that could carry a secret are
redacted. With tracing off, ``CallTrace.start`` returns ``NO_TRACE``, whose methods do nothing.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import redis
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.metrics import Observation
from opentelemetry.trace import Link, SpanKind

from broker import keys, otel
from broker.calls import stats_name
from broker.codec import text
from broker.errors import CallCancelled
from broker.logs import redact, redact_text
from broker.otel import MESSAGING_SYSTEM, error_type, mark_failed, parent_context, traceparent_of
from workers.hooks import Hook, Writer

if TYPE_CHECKING:
    from broker.envelope import Envelope
    from broker.toolspec import ToolSpec
    from workers.runner import Running


ARGS_LIMIT = 1024
_NULL: AbstractContextManager[Any] = nullcontext()


def _args_attribute(args: Mapping[str, Any] | None, sensitive: Sequence[str]) -> str:
    if not args:
        return "{}"
    text = json.dumps(redact(dict(args), sensitive), ensure_ascii=False, default=str)
    return text if len(text) <= ARGS_LIMIT else text[: ARGS_LIMIT - 1] + "…"


class _Phase:
    """A span we end ourselves on leaving, with ``ctx`` current meanwhile (the executor's, the provider's)."""

    __slots__ = ("span", "ctx", "_token")

    def __init__(self, span: Any, ctx: otel_context.Context) -> None:
        self.span = span
        self.ctx = ctx
        self._token: Any = None

    def __enter__(self) -> Any:
        self._token = otel_context.attach(self.ctx)
        return self.span

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None
        _ended(self.span, exc)


def _ended(span: Any, exc: BaseException | None) -> None:
    if exc is not None:
        if isinstance(exc, CallCancelled):
            span.add_event("cancelled")
        else:
            mark_failed(span, exc)
    span.end()


def _start(
    tracer: Any, name: str, parent: Any, kind: SpanKind, attributes: dict[str, Any], links: Any = ()
) -> Any:
    # We end (and mark) our spans ourselves, so the SDK's own exception recording stays off.
    return tracer.start_span(
        name, context=parent, kind=kind, attributes=attributes, links=links, record_exception=False,
        set_status_on_exception=False,
    )


class NoTrace:
    """Tracing off: every method does nothing."""

    span_id: str | None = None
    span: Any = None

    def open(self, name: str) -> None: ...

    def close(self, name: str, error: BaseException | None = None) -> None: ...

    def executor(
        self, spec: Any, args: Mapping[str, Any], ctx: Any, sensitive: Sequence[str] = ()
    ) -> AbstractContextManager[Any]:
        return _NULL

    def provider(self, model: str, provider: str, ctx: Any) -> AbstractContextManager[Any]:
        return _NULL

    def retry(self, attempt: int, delay: float, error: BaseException | Mapping[str, Any]) -> None: ...

    def end(self, state: str, error: Mapping[str, Any] | None = None) -> None: ...

    def finish(self) -> None: ...


NO_TRACE = NoTrace()


class CallTrace(NoTrace):
    """The spans of one call in this worker: ``process <queue>`` and its children, whose parent is passed
    explicitly; the context is current only around the executor and the provider (user code runs there)."""

    def __init__(self, tracer: Any, env: Envelope, attempt: int, claimed_at: float) -> None:
        self.tracer = tracer
        parent = parent_context(env.traceparent, env.tracestate, env.baggage)
        caller = trace.get_current_span(parent).get_span_context()
        wait = max(0.0, claimed_at - float(env.submitted_at))
        attributes: dict[str, Any] = {
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": env.queue,
            "messaging.message.id": env.call_id,
            "hermes.call.kind": env.kind,
            "hermes.call.attempt": attempt,
            "hermes.queue.wait_ms": round(wait * 1000, 3),
        }
        tool_call_id = env.context.get("tool_call_id")
        self.tool_call_id = str(tool_call_id or env.call_id)
        if env.kind == "tool":
            attributes["gen_ai.tool.name"] = env.tool or ""
            if tool_call_id:
                attributes["gen_ai.tool.call.id"] = str(tool_call_id)
        else:
            attributes["gen_ai.request.model"] = env.name
        if env.context.get("session_id"):
            attributes["session.id"] = str(env.context["session_id"])
        # Parent: the producer span (one message, so the creation context is the parent); also a link.
        links = [Link(caller)] if caller.is_valid else None
        self.span = _start(tracer, f"process {env.queue}", parent, SpanKind.CONSUMER, attributes, links)
        self.ctx = trace.set_span_in_context(self.span, parent)
        self.span_id = f"{self.span.get_span_context().span_id:016x}"
        self._open: dict[str, Any] = {}
        self._chain_ctx: Any = None  # the tool_execution span's context while it is open
        self._ended = False

    @classmethod
    def start(cls, env: Envelope, attempt: int, claimed_at: float | None = None) -> NoTrace:
        """The call's trace when tracing is on, else ``NO_TRACE``."""
        tracer = otel.tracer()
        if tracer is None:
            return NO_TRACE
        return cls(tracer, env, attempt, time.time() if claimed_at is None else claimed_at)

    def _parent(self) -> Any:
        return self._chain_ctx if self._chain_ctx is not None else self.ctx

    def open(self, name: str) -> None:
        """Start a phase span that callbacks end later (``tool_request`` ends when the checks begin)."""
        if name not in self._open:
            span = _start(self.tracer, name, self._parent(), SpanKind.INTERNAL, {})
            self._open[name] = span
            if name == "tool_execution":
                self._chain_ctx = trace.set_span_in_context(span, self.ctx)

    def close(self, name: str, error: BaseException | None = None) -> None:
        """End a phase span ``open`` started (marked failed when ``error`` ended it)."""
        span = self._open.pop(name, None) if self._open else None
        if span is not None:
            _ended(span, error)
        if name == "tool_execution":
            self._chain_ctx = None

    def executor(
        self, spec: Any, args: Mapping[str, Any], ctx: Any, sensitive: Sequence[str] = ()
    ) -> AbstractContextManager[Any]:
        """``execute_tool <tool>``; the executor forwards this span's context (``ctx.traceparent``)."""
        attributes = dict(_tool_attributes(spec.name, spec.executor))
        attributes["gen_ai.tool.call.id"] = self.tool_call_id
        attributes["gen_ai.tool.call.arguments"] = _args_attribute(args, sensitive)
        parent = self._parent()
        span = _start(self.tracer, f"execute_tool {spec.name}", parent, SpanKind.INTERNAL, attributes)
        ctx.traceparent = traceparent_of(span)
        state = span.get_span_context().trace_state
        ctx.tracestate = state.to_header() if state else None
        return _Phase(span, trace.set_span_in_context(span, parent))

    def provider(self, model: str, provider: str, ctx: Any) -> AbstractContextManager[Any]:
        """``chat <model>`` around one provider request; the provider forwards this span's context."""
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "hermes.attempt": getattr(ctx, "attempt", 1),
        }
        parent = self._parent()
        span = _start(self.tracer, f"chat {model}", parent, SpanKind.CLIENT, attributes)
        ctx.traceparent = traceparent_of(span)
        return _Phase(span, trace.set_span_in_context(span, parent))

    def retry(self, attempt: int, delay: float, error: BaseException | Mapping[str, Any]) -> None:
        """A retry as a span event: which attempt failed, why, and the wait before the next one."""
        message = str(error.get("message") or "") if isinstance(error, Mapping) else str(error)
        self.span.add_event(
            "retry",
            {
                "hermes.attempt": attempt,
                "hermes.retry.delay_s": round(delay, 3),
                "error.type": error_type(error),
                "exception.message": redact_text(message)[:500],
            },
        )

    def end(self, state: str, error: Mapping[str, Any] | None = None) -> None:
        """Record the call's outcome and end every span still open (once)."""
        if self._ended:
            return
        self._ended = True
        for name in list(self._open):
            self.close(name)
        self.span.set_attribute("hermes.call.state", state)
        if error is not None and state != "cancelled":
            mark_failed(self.span, error)
        self.span.end()

    def finish(self) -> None:
        """The call is over here: ends the span if ``end`` was not called."""
        if not self._ended:
            self.end("abandoned")


@functools.lru_cache(maxsize=1024)
def _tool_attributes(name: str, executor: str) -> Mapping[str, Any]:
    return {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.type": "function",
        "hermes.executor": executor,
    }


def record_usage(span: Any, response: Any) -> None:
    """``gen_ai.usage.*`` and response attributes from a chat completion."""
    if span is None or not isinstance(response, Mapping):
        return
    usage = response.get("usage")
    if isinstance(usage, Mapping):
        for ours, theirs in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
            value = usage.get(theirs, usage.get(ours))
            if isinstance(value, int) and not isinstance(value, bool):
                span.set_attribute(f"gen_ai.usage.{ours}", value)
    if response.get("model"):
        span.set_attribute("gen_ai.response.model", str(response["model"]))
    if response.get("id"):
        span.set_attribute("gen_ai.response.id", str(response["id"]))
    reasons = [
        str(c.get("finish_reason"))
        for c in response.get("choices") or []
        if isinstance(c, Mapping) and c.get("finish_reason")
    ]
    if reasons:
        span.set_attribute("gen_ai.response.finish_reasons", reasons)


class CallSpans(Hook):
    """A tool call's phase spans under ``process <queue>`` and ``execute_tool <tool>`` around the executor."""

    def _registered(self, run: Running, stage: str) -> bool:
        return run.trace.span is not None and self.core.plugins.runtime.has_middleware(stage)

    def before_flow(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        if self._registered(run, "tool_request"):
            run.trace.open("tool_request")

    def before_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        run.trace.close("tool_request")
        run.trace.open("policy")

    def after_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        run.trace.close("policy", error)
        if error is None and self._registered(run, "tool_execution"):
            run.trace.open("tool_execution")

    def before_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        run.span = run.trace.executor(spec, args, run.ctx, spec.sensitive)
        run.span.__enter__()

    def after_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        span, run.span = run.span, None
        if span is not None:
            span.__exit__(type(error) if error is not None else None, error, None)

    def after_flow(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        run.trace.close("tool_execution")

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None:
        run.trace.end(outcome, error)


# -- figures ---------------------------------------------------------------------------------------
# OpenTelemetry metrics when a meter provider is set, and the same figures summed per process and added to
# the ``hermes:stats`` hash once a second (``status --watch``, the console, ``serve``'s ``/metrics``), with
# durations also counted in fixed buckets (``lat|<kind>|<name>|<bucket>``).

BREAKER_STATES = {"closed": 0, "half_open": 1, "half-open": 1, "open": 2}
FLUSH_INTERVAL = 1.0
INFLIGHT_NAMED = 60.0  # seconds a worker stays named in hermes:stats:inflight after its last in-flight write
SEP = keys.STATS_SEP
# Upper bounds (seconds, inclusive, as Prometheus' ``le``) of the duration buckets; the last bucket (index
# len(LATENCY_BOUNDS)) holds everything slower.
LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def latency_bucket(seconds: float) -> int:
    """The index of the bucket a duration falls in (``le`` semantics: 0.001 is in bucket 0)."""
    return bisect_left(LATENCY_BOUNDS, seconds)


@dataclass
class Timing:
    """Seconds summed over ``n`` calls: a call name's durations, a queue's waits."""

    seconds: float = 0.0
    n: int = 0

    @property
    def mean(self) -> float:
        return self.seconds / self.n if self.n else 0.0


@dataclass
class Stats:
    """``hermes:stats`` parsed, each mapping in the order the hash lists its fields; (kind, name): a call."""

    calls: dict[tuple[str, str, str, str], int] = field(default_factory=dict)  # + state, error type or ""
    names: dict[tuple[str, str], None] = field(default_factory=dict)  # with calls or durations, first listed
    durations: dict[tuple[str, str], Timing] = field(default_factory=dict)
    latency: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # calls per latency_bucket
    waits: dict[str, Timing] = field(default_factory=dict)  # per queue
    pcalls: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (principal, kind, name)
    tokens: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (principal, model, "in" | "out")
    breakers: dict[str, str] = field(default_factory=dict)  # key -> the state a worker last reported


def parse_stats(raw: Mapping[str, str]) -> Stats:
    """The figures of ``hermes:stats``, its fields named as the writers below name them (others skipped)."""
    s = Stats()
    for name, value in raw.items():
        what, *rest = name.split(SEP)
        try:
            if what == "calls" and len(rest) >= 4:
                label = (rest[0], SEP.join(rest[1:-2]))
                s.calls[(*label, rest[-2], rest[-1])] = int(value)
                s.names.setdefault(label)
            elif what in ("duration", "duration_n") and len(rest) >= 2:
                label = (rest[0], SEP.join(rest[1:]))
                _timing(s.durations, label, what, value)
                s.names.setdefault(label)
            elif what == "lat" and len(rest) >= 3 and 0 <= (i := int(rest[-1])) <= len(LATENCY_BOUNDS):
                label, n = (rest[0], SEP.join(rest[1:-1])), int(value)
                s.latency.setdefault(label, [0] * (len(LATENCY_BOUNDS) + 1))[i] += n
            elif what in ("wait", "wait_n") and rest:
                _timing(s.waits, SEP.join(rest), what, value)
            elif what == "pcalls" and len(rest) >= 3:
                s.pcalls[(rest[0], rest[1], SEP.join(rest[2:]))] = int(value)
            elif what == "tokens" and len(rest) >= 3 and rest[-1] in ("in", "out"):
                s.tokens[(rest[0], SEP.join(rest[1:-1]), rest[-1])] = int(value)
            elif what == "breaker" and rest:
                s.breakers[SEP.join(rest)] = value
        except ValueError:  # a damaged figure
            continue
    return s


def _timing(into: dict[Any, Timing], key: Any, what: str, value: str) -> None:
    """Set the sum (``duration``, ``wait``) or the count (``…_n``) of ``into[key]``."""
    if what.endswith("_n"):
        into.setdefault(key, Timing()).n = int(value)  # (the value parses before the entry is made)
    else:
        into.setdefault(key, Timing()).seconds = float(value)


def read_stats(conn: redis.Redis) -> Stats:
    """``hermes:stats``: what every worker's flushes summed (one round trip)."""
    return parse_stats({text(k): text(v) for k, v in conn.hgetall(keys.STATS).items()})


def read_inflight(conn: redis.Redis) -> dict[str, int]:
    """Calls executing per concurrency key, summed over the in-flight hashes (``StatsFlusher``) of the
    processes that wrote one lately (``hermes:stats:inflight``, stock RQ workers' too; a dead one's hash
    expires): two round trips, however many keys the Redis holds (a SCAN for the hashes read every key of
    it, each console tick and status read)."""
    names = conn.zrangebyscore(keys.STATS_INFLIGHT_BY, time.time() - INFLIGHT_NAMED, "+inf")
    if not names:
        return {}
    pipe = conn.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.stats_inflight(text(name)))
    out: dict[str, int] = {}
    for running in pipe.execute():
        for ckey, n in running.items():
            out[text(ckey)] = out.get(text(ckey), 0) + int(n)
    return out


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


class _Totals:
    """What this process adds to ``hermes:stats`` at the next flush."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.sums: dict[str, float] = {}
        self.breakers: dict[str, str] = {}  # current state per key (also read by the gauge)
        self.breakers_dirty: set[str] = set()

    def add(self, counts: Iterable[tuple[str, int]], sums: Iterable[tuple[str, float]] = ()) -> None:
        with self.lock:
            for f, n in counts:
                self.counts[f] = self.counts.get(f, 0) + n
            for f, v in sums:
                self.sums[f] = self.sums.get(f, 0.0) + v

    def take(self) -> tuple[dict[str, int], dict[str, float], dict[str, str]]:
        with self.lock:
            counts, sums = self.counts, self.sums
            breakers = {k: self.breakers[k] for k in self.breakers_dirty}
            self.counts, self.sums, self.breakers_dirty = {}, {}, set()
        return counts, sums, breakers


class _Labels:
    """A value of a label a caller chooses (an LLM call's model, a principal) as hermes:stats and the
    instruments show it: itself while ``keys.STATS_MAX_NAMES`` values of the label at most are in Redis
    (``calls.stats_name``, over every process), else ``keys.STATS_OTHER``; the admitted ones are kept. A tool's
    name is shown as it is: only who may manage tools makes one, and a call to no such tool never runs. A value
    refused is remembered too (up to ``OTHERS_KEPT``), so invented names cost no round trip a call."""

    OTHERS_KEPT = 10_000

    def __init__(self) -> None:
        self.conn: redis.Redis | None = None  # (the stats flusher's: none, every value shows)
        self.known: set[tuple[str, str]] = set()
        self.others: set[tuple[str, str]] = set()

    def __call__(self, label: str, value: str) -> str:
        if self.conn is None or label not in keys.STATS_CAPPED or (label, value) in self.known:
            return value
        if (label, value) in self.others:
            return keys.STATS_OTHER
        try:
            admitted = int(stats_name(self.conn, label, value))
        except redis.RedisError:
            return keys.STATS_OTHER  # (not kept: asked again next time)
        if admitted:
            self.known.add((label, value))
        elif len(self.others) < self.OTHERS_KEPT:
            self.others.add((label, value))
        return value if admitted else keys.STATS_OTHER


_totals = _Totals()
_labels = _Labels()
_queue_conns: list[redis.Redis] = []


def call_started(ckey: str, queue: str, wait_s: float) -> None:
    """A worker began a call that waited ``wait_s`` seconds on ``queue``."""
    _totals.add(((f"wait_n{SEP}{queue}", 1),), ((f"wait{SEP}{queue}", wait_s),))
    inst = _instruments()
    if inst is not None:
        inst.inflight.add(1, {"hermes.concurrency_key": ckey})
        inst.queue_wait.record(wait_s, {"messaging.destination.name": queue})


def call_ended(
    ckey: str, kind: str, name: str, state: str, error_type: str | None, duration_s: float | None,
    inflight: bool = True,
) -> None:
    """A call this worker ran reached a terminal state (or was handed back); ``inflight``: it was counted.
    ``duration_s`` None: it never reached its executor or provider (refused by the policy, its arguments, an
    open breaker, a budget, a hook): counted, but its ~0 s would only drag the durations down."""
    name = _labels(kind, name)
    label = f"{kind}{SEP}{name}"
    counts: list[tuple[str, int]] = [(keys.stats_ended(kind, name, state, error_type), 1)]
    if duration_s is not None:
        counts += [(f"duration_n{SEP}{label}", 1), (f"lat{SEP}{label}{SEP}{latency_bucket(duration_s)}", 1)]
    _totals.add(counts, ((f"duration{SEP}{label}", duration_s),) if duration_s is not None else ())
    inst = _instruments()
    if inst is not None:
        if inflight:
            inst.inflight.add(-1, {"hermes.concurrency_key": ckey})
        attrs = {"hermes.call.kind": kind, "hermes.call.name": name, "hermes.call.state": state}
        if duration_s is not None:
            inst.duration.record(duration_s, attrs)
        if error_type:
            attrs = {**attrs, "error.type": error_type}
        inst.calls.add(1, attrs)


def breaker_changed(key: str, old: str, new: str) -> None:
    """A circuit breaker moved from ``old`` to ``new`` (closed | half_open | open): call on each change."""
    with _totals.lock:
        _totals.breakers[key] = new
        _totals.breakers_dirty.add(key)
    _totals.add(((f"breaker_changes{SEP}{key}", 1),))
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
    with _totals.lock:
        current = dict(_totals.breakers)
    return [Observation(BREAKER_STATES.get(s, 0), {"hermes.breaker.key": k}) for k, s in current.items()]


def _observe_queues(_options: Any) -> Iterable[Any]:
    if not _queue_conns:
        return []
    try:
        depths = queue_depths(_queue_conns[0])
        return [Observation(depth, {"messaging.destination.name": q}) for q, depth in depths]
    except redis.RedisError:
        return []


def queue_depths(conn: redis.Redis) -> list[tuple[str, int]]:
    """``(queue, calls waiting)`` for every RQ queue, in one round trip after the queue list."""
    names = sorted(text(k) for k in conn.smembers(keys.RQ_QUEUES))
    pipe = conn.pipeline(transaction=False)
    for k in names:
        pipe.llen(k)
    return [(keys.queue_name(k), int(d)) for k, d in zip(names, pipe.execute(), strict=True)]


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
        self.conn = _labels.conn = conn
        self.worker = worker
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
            now = time.time()  # (read_inflight reads the names; the writers, not the readers, drop old ones)
            pipe.zadd(keys.STATS_INFLIGHT_BY, {self.worker: now})
            pipe.zremrangebyscore(keys.STATS_INFLIGHT_BY, "-inf", now - INFLIGHT_NAMED)
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


class CallMetrics(Hook):
    """Queue wait and in-flight count when a call begins, outcome and duration when it ends."""

    def before_call(self, run: Running) -> None:
        call_started(run.info.ckey, run.info.queue, run.queue_wait)

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None:
        info = run.info
        err_type = str(error.get("type") or "error") if error else None
        # An undecodable payload never started (claimed_at 0), so it was never counted in flight.
        ran = duration if run.ran else None
        call_ended(info.ckey, info.kind, info.name, outcome, err_type, ran, bool(run.claimed_at))


DAY_TTL = 2 * 86400


class Usage(Hook):
    """A call of its principal for the stats flush (``pcalls|<principal>|<kind>|<name>``), and an LLM call's
    tokens (``tokens|<principal>|<model>|in`` / ``out``), also added to the principal's daily total (what the
    ``daily_tokens`` budget reads) in the terminal move's pipeline."""

    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        principal = run.env.context.get("principal") if run.env is not None else None
        info, tokens = run.info, run.usage
        # (a principal holding the separator would read back as another: its figures would be that one's)
        who = "-" if not principal else keys.STATS_OTHER if SEP in principal else _labels("principal", principal)
        name = _labels(info.kind, info.name)
        counts = [(f"pcalls{SEP}{who}{SEP}{info.kind}{SEP}{name}", 1)]
        if tokens is not None and (tokens["in"] or tokens["out"]):
            prefix = f"tokens{SEP}{who}{SEP}{name}{SEP}"
            counts += [(prefix + "in", tokens["in"]), (prefix + "out", tokens["out"])]
        _totals.add(counts)
        if not principal or tokens is None:
            return None
        key = keys.usage_day(time.strftime("%Y-%m-%d", time.gmtime()), str(principal))
        total = tokens["in"] + tokens["out"]

        def write(pipe: Any) -> None:
            pipe.incrby(key, total)
            pipe.expire(key, DAY_TTL)

        return write
