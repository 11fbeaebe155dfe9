"""The client core shared by the threaded ``Gateway`` and the asyncio ``AsyncGateway``: broker discovery,
call options, envelopes and admission limits (no I/O), the worker check, event routing (``Router``),
handle state (``CallState``) and the operations both run (``ClientCore``: submit, settle, cancel, look up,
catch up), written once as ``Steps``. Each client adds only its own way of doing I/O and of waiting."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import redis
import structlog

from broker import durability, keys
from broker import events as ev_mod
from broker.calls import CallInfo, Calls, stats_name
from broker.codec import MAX_DEPTH, nesting, pack, text, unpack
from broker.config import MAX_ARGS_ENV, Settings
from broker.connection import BrokerHandle, answered, broker_error, connect, is_cluster, subscriber
from broker.directory import Directory, Entry
from broker.envelope import (
    CALL_CLASSES,
    CONTEXT_FIELDS,
    Envelope,
    Options,
    concurrency_key,
    fairness_of,
    new_call_id,
)
from broker.errors import (
    CallCancelled,
    CallFailed,
    DecodeError,
    GatewayClosed,
    HermesError,
    InvalidArgs,
    InvalidSpec,
    NoWorkers,
    TokensOverLimit,
    error_from_wire,
)
from broker.events import Event
from broker.otel import ensure_traceparent, headers_of, new_span_id
from broker.ratelimits import RateLimit, estimate_tokens
from broker.states import TERMINAL, State
from broker.toolspec import ToolSpec
from hermes_gateway.tracing import Headers, Sending

log = structlog.get_logger("hermes.client")

MAX_FAIRNESS_KEY = 256  # characters of a fairness key (it is a field of a hash in Redis)
MAX_IDEMPOTENCY_KEY = 256  # characters of an idempotency key (a Redis key's name, kept with the call)
WORKERS_TRUSTED = 5.0  # seconds a queue seen with a live worker is not checked again (check_workers)
ENDED_KEPT = 1000  # ended calls' handles the asyncio client keeps for `handle(id)` (the HTTP API's streams)
ENDED_EVENTS_KEPT = 100_000  # and the events they hold at most (~1 KB each; a streamed reply has one a chunk)


# -- the broker ----------------------------------------------------------------------------------


def find_broker(settings: Settings, url: str | None = None, *, embedded_ok: bool = True) -> BrokerHandle:
    """A client's broker: ``url`` / ``$HERMES_REDIS_URL`` / ``broker.url``; else the embedded broker of a
    ``serve`` or ``worker`` of the same ``$HERMES_HOME`` here; else (``embedded_ok``) one of its own."""
    url = url or settings.broker.url
    if url is None and embedded_ok:
        from hermes_gateway.local import connect_local

        return connect_local(settings)[0]
    return connect(url, embedded_ok=embedded_ok)


def register_dir(directory: Directory, path: Any, errors: list[InvalidSpec] | None = None) -> list[tuple[str, int, bool]]:
    """Register every spec file of ``path``; one that does not load is skipped, put in ``errors`` when
    given, else logged."""
    from pathlib import Path

    from workers.specs import sync_dir

    bad: list[InvalidSpec] = [] if errors is None else errors
    done = sync_dir(directory, Path(path), bad)
    if errors is None:
        for e in bad:
            log.warning("tool spec skipped", error=str(e))
    return done


class WorkerCheck:
    """With ``check_workers``, a call to a queue nobody serves is refused (``NoWorkers``), or on an embedded
    broker of the client's own a worker is started for it (stopped by ``close``). Blocking I/O."""

    def __init__(self, broker: BrokerHandle, settings: Settings, check_workers: bool) -> None:
        self.broker = broker
        self.conn: redis.Redis = broker.conn
        self.settings = settings
        self.check_workers = check_workers
        self._seen: dict[str, float] = {}  # queue -> until when a seen worker is trusted
        self._own: list[Any] = []
        self._lock = threading.Lock()  # (two threads' first calls start one worker, not two)

    def live_workers(self, queue: str | None = None, within: float | None = None) -> list[dict[str, Any]]:
        """Workers whose heartbeat is recent, optionally only those listening on ``queue``."""
        horizon = time.time() - (within or max(15.0, self.settings.workers.lease))
        names = self.conn.zrangebyscore(keys.WORKERS, horizon, "+inf")
        pipe = self.conn.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.worker(text(n)))
        workers = [{k.decode(): v.decode() for k, v in raw.items()} for raw in pipe.execute() if raw]
        return [w for w in workers if queue is None or queue in w.get("queues", "").split(",")]

    def require_workers(self, queue: str) -> None:
        """NoWorkers unless a live worker listens on ``queue``."""
        if not self.live_workers(queue):
            raise NoWorkers(
                f"no worker listens on queue {queue!r} at {self.broker.description}; start one with "
                f"`hermes-gateway worker --queues {queue}`",
                queue=queue,
            )

    def unchecked(self, queues: Iterable[str]) -> bool:
        """Whether ``ensure(queues)`` has anything to ask the broker (no I/O)."""
        now = time.monotonic()
        return self.check_workers and any(self._seen.get(q, 0.0) <= now for q in queues)

    def ensure(self, queues: Iterable[str]) -> None:
        """The check on ``queues`` (a partition counts as its base queue); a queue seen served is trusted
        for ``WORKERS_TRUSTED`` seconds."""
        if not self.check_workers:
            return
        for queue in dict.fromkeys(keys.base_queue(q) for q in queues):
            if self._seen.get(queue, 0.0) > time.monotonic():
                continue
            with self._lock:
                if not self.live_workers(queue):
                    if self.broker.embedded is None:
                        self.require_workers(queue)  # raises
                    from hermes_gateway.local import start_workers, wait_for_heartbeats

                    self._own += start_workers(self.broker.url, self.settings, (queue,))
                    wait_for_heartbeats(self, 1, queues=(queue,))  # type: ignore[arg-type]
                self._seen[queue] = time.monotonic() + WORKERS_TRUSTED

    def close(self) -> None:
        """Stop the workers this check started."""
        if self._own:
            from workers.pool import stop_all

            stop_all(self._own)
            self._own = []


# -- options and envelopes -----------------------------------------------------------------------


@dataclass(frozen=True)
class CallOptions:
    """The keyword options of one call (``call_tool``, ``call_llm``, each item of ``submit_many``)."""

    timeout: float | None = None
    idempotency_key: str | None = None
    max_attempts: int | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    queue: str | None = None
    fairness_key: str | None = None
    call_class: str | None = None
    # (set by the client: the producer span's headers, a batch item's id and partition)
    trace_headers: Headers | None = None
    call_id: str | None = None
    partition_slot: int | None = None

    # What map/submit_many take as common options (a batch takes idempotency_keys=, one per item).
    COMMON = ("timeout", "max_attempts", "traceparent", "tracestate", "queue", "fairness_key", "call_class")

    @classmethod
    def take(cls, common: dict[str, Any]) -> CallOptions:
        """The options among a batch's ``common`` keywords, removed from it (the rest is call context)."""
        return cls(**{k: common.pop(k) for k in cls.COMMON if k in common})

    def item(self, idem_keys: Sequence[str | None] | None, i: int) -> CallOptions:
        """The options of batch item ``i``: these, with its idempotency key if it has one."""
        if idem_keys is None or i >= len(idem_keys) or idem_keys[i] is None:
            return self
        return dataclasses.replace(self, idempotency_key=idem_keys[i])

    def headers(self) -> Headers:
        """The trace context to send: the client's (``Sending.headers``), else the caller's own or the
        current one."""
        if self.trace_headers is not None:
            return self.trace_headers
        return (self.traceparent, self.tracestate, None) if self.traceparent is not None else headers_of()

    def envelope_options(self) -> Options:
        """The envelope's options, with a typed error for a bad fairness key or class (``call_class``:
        ``interactive`` or ``batch``)."""
        fkey, klass, idem = self.fairness_key, self.call_class, self.idempotency_key
        if fkey is not None and (not isinstance(fkey, str) or not fkey or len(fkey) > MAX_FAIRNESS_KEY):
            raise InvalidArgs(f"fairness_key must be a non-empty string of at most {MAX_FAIRNESS_KEY} characters, "
                              f"got {fkey!r:.80}")
        if idem is not None and (not isinstance(idem, str) or len(idem) > MAX_IDEMPOTENCY_KEY):
            raise InvalidArgs(f"idempotency_key must be a string of at most {MAX_IDEMPOTENCY_KEY} characters, "
                              f"got {idem!r:.80}")
        if klass is not None and klass not in CALL_CLASSES:
            raise InvalidArgs(f"call_class must be one of {', '.join(CALL_CLASSES)}, got {klass!r}")
        timeout, attempts = self.timeout, self.max_attempts
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise InvalidArgs(f"timeout must be a number of seconds above 0, got {timeout!r}")
        if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1):
            raise InvalidArgs(f"max_attempts must be an integer of at least 1, got {attempts!r}")
        return Options(
            timeout=self.timeout, idempotency_key=self.idempotency_key, max_attempts=self.max_attempts,
            fairness_key=fkey, call_class=klass,
        )


def check_sendable(value: Any, what: str, limit: int | None = None) -> bytes:
    """``value`` packed (the envelope keeps these bytes), or InvalidArgs for what the wire cannot carry,
    what nests deeper than ``MAX_DEPTH`` (later code recurses) or packs larger than ``limit`` bytes."""
    depth = nesting(value)
    if depth > MAX_DEPTH:
        raise InvalidArgs(f"{what} are nested more than {MAX_DEPTH} levels deep", limit=MAX_DEPTH)
    if depth < 0:
        raise InvalidArgs(f"{what} have a key that is not text (names and mapping keys are strings)")
    try:
        packed = pack(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidArgs(
            f"{what} cannot be sent: {e} (values travel as msgpack: JSON-like types, bytes; sets and "
            "tuples become lists, dates ISO text)"
        ) from e
    if limit is not None and len(packed) > limit:
        raise InvalidArgs(
            f"{what} take {len(packed)} bytes, over the limit of {limit} (broker.max_args in config.yaml, "
            f"${MAX_ARGS_ENV}); pass large data by reference (a path, a URL) instead",
            size=len(packed),
            limit=limit,
        )
    return packed


def check_context(context: dict[str, Any]) -> None:
    """Refuse call-context fields the envelope does not know (a typo would otherwise vanish), and values
    that are not text (an integer id is made text here; a list or mapping is InvalidArgs)."""
    unknown = set(context) - set(CONTEXT_FIELDS)
    if unknown:
        known = ", ".join(CONTEXT_FIELDS)
        raise TypeError(f"unknown call context field(s): {', '.join(sorted(unknown))}; known: {known}")
    for name, value in context.items():
        if value is None or type(value) is str:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            context[name] = str(value)
            continue
        raise InvalidArgs(f"context field {name} must be text, got {type(value).__name__}", field=name)


def check_llm_request(request: Any, context: dict[str, Any]) -> None:
    """Refuse an LLM request that is not a mapping, whose ``messages`` (chat completions) are not a list of
    mappings, that has neither ``messages`` nor ``input`` (the Responses API), or unknown context fields."""
    if not isinstance(request, dict):
        raise InvalidArgs(f"an LLM request must be a mapping, got {type(request).__name__}")
    messages = request.get("messages")
    if messages is None and request.get("input") is None:
        raise InvalidArgs("an LLM request needs messages (chat completions) or input (the Responses API)")
    if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        raise InvalidArgs(f"an LLM request's messages must be a list of mappings, got {type(messages).__name__}")
    if request.get("model") is not None and type(request["model"]) is not str:
        raise InvalidArgs(f"an LLM request's model must be text, got {type(request['model']).__name__}")
    for key in ("extra_headers", "extra_body", "extra_query"):  # (the provider merges them as mappings)
        if request.get(key) is not None and not isinstance(request[key], dict):
            raise InvalidArgs(f"an LLM request's {key} must be a mapping, got {type(request[key]).__name__}", field=key)
    check_context(context)


def check_batch_keys(common: dict[str, Any], idem_keys: Sequence[str | None] | None, n: int) -> None:
    """A batch takes one idempotency key (or None) per item, never one key for all of them; ``n`` items."""
    if "idempotency_key" in common or isinstance(idem_keys, str | bytes):
        raise TypeError("map/submit_many take idempotency_keys= (one key or None per item), not one key")
    if idem_keys is not None and len(idem_keys) != n:
        raise ValueError(f"idempotency_keys has {len(idem_keys)} entries for {n} calls")


def tool_envelope(
    entry: Entry, name: str, args: dict[str, Any] | None, opts: CallOptions, context: dict[str, Any],
    channel: Callable[[str], str], settings: Settings,
) -> Envelope:
    """The envelope of one call of ``entry``; events go to ``channel(queue)``, a split tool's call to its next
    partition."""
    spec = entry.spec
    check_context(context)
    if args is not None and not isinstance(args, dict):
        raise InvalidArgs(f"arguments for {name!r} must be a mapping, got {type(args).__name__}")
    args = args or {}
    packed = check_sendable(args, f"arguments for {name!r}", settings.broker.max_args)
    queue = opts.queue or str(spec.config.get("queue") or "tools")
    n = keys.partition_count(spec)
    if n > 1:
        concurrency = spec.concurrency or settings.concurrency_for(spec.executor)
        queue = keys.partition_route(queue, n, concurrency, opts.idempotency_key, opts.partition_slot)
    return _envelope(opts, queue, context, channel, packed, kind="tool", tool=name, args=args, tool_version=entry.version)


def _envelope(opts: CallOptions, queue: str, context: dict[str, Any], channel: Callable[[str], str], packed: bytes,
              **call: Any) -> Envelope:
    """The envelope of a call (``call``: its kind and what it asks) on ``queue``, keeping its ``packed`` arguments."""
    tp, ts, bg = opts.headers()
    return Envelope(
        call_id=keys.call_id(queue, opts.call_id or new_call_id()),
        context={k: v for k, v in context.items() if v is not None}, traceparent=ensure_traceparent(tp),
        tracestate=ts, baggage=bg, options=opts.envelope_options(), queue=queue, channel=channel(queue), **call,
    ).keep_packed(packed)


def tool_limits(env: Envelope, spec: ToolSpec, settings: Settings) -> dict[str, Any]:
    """Admission limits of a tool call: concurrency key and limit, queue size, attempts, timeout."""
    queue_size = settings.queue_size_for(spec.executor) if spec.queue_size is None else spec.queue_size
    retries = int((spec.retry or {}).get("max") or 0)
    concurrency = spec.concurrency or settings.concurrency_for(spec.executor)
    # A partition's share of the tool's limit, queue size and per-key bound.
    n = keys.partition_count(spec)
    per_key = settings.fairness.queue_size_per_key
    key_size = -1 if per_key is None else keys.partition_limits(env.queue, n, concurrency, per_key)[1]
    concurrency, queue_size = keys.partition_limits(env.queue, n, concurrency, queue_size)
    rate = RateLimit.parse(f"tool {spec.name!r}", spec.config.get("rate_limit"))
    if rate is not None and n > 1:
        rate = rate.share(n, keys.partition_index(env.queue))
    return {
        "ckey": concurrency_key(env),
        "queue_size": queue_size,
        "concurrency": concurrency,
        "max_attempts": env.options.max_attempts or max(settings.workers.max_attempts, retries + 1),
        "timeout": float(env.options.timeout or spec.timeout),
        "rate_limit": rate,
        **fair_limits(env, settings, key_size),
    }


def fair_limits(env: Envelope, settings: Settings, key_size: int) -> dict[str, Any]:
    """SUBMIT's fairness limits: the key's weight, the batch share, the per-key bound (-1: none)."""
    fairness = settings.fairness
    return {
        "weight": fairness.weight_of(env.context.get("principal"), fairness_of(env)[0]),
        "batch_share": fairness.batch_share,
        "key_size": key_size,
    }


LLM_NAME = re.compile(r"[A-Za-z0-9@][A-Za-z0-9._:/@+-]{0,127}")  # (@cf/meta/llama-3.1-8b-instruct)


def llm_envelope(
    request: dict[str, Any], settings: Settings, opts: CallOptions, context: dict[str, Any],
    channel: Callable[[str], str],
) -> tuple[Envelope, dict[str, Any]]:
    """The envelope and limits of one LLM call (chat-completions kwargs, ``check_llm_request``-ed)."""
    packed = check_sendable(request, "the LLM request", settings.broker.max_args)
    context = dict(context)
    model_cfg = settings.model
    provider = model_cfg.provider or "openai-compatible"  # (the one the workers call, whatever the context says)
    context.setdefault("provider", provider)
    context.setdefault("api_mode", model_cfg.api_mode or "chat_completions")
    context["model"] = request.get("model") or context.get("model") or model_cfg.model or None
    for field in ("model", "provider"):  # (they name the call's concurrency key, its metrics and status rows)
        value = context.get(field)
        if value is not None and not LLM_NAME.fullmatch(str(value)):
            raise InvalidArgs(
                f"the LLM call's {field} {str(value)[:80]!r} is not a name: 1-128 letters, digits and . _ : / @ + -",
                field=field,
            )
    per_key = settings.fairness.queue_size_per_key
    env = _envelope(opts, opts.queue or "llm", context, channel, packed, kind="llm", request=request)
    ckey = concurrency_key(env)
    rate = model_cfg.rate_limit_for(provider, str(context.get("model") or ""))
    estimate = estimate_tokens(request) if rate is not None else 0
    if rate is not None and 0 <= rate.tpm < estimate:
        raise TokensOverLimit(
            f"the LLM call's token estimate ({estimate}: max_tokens + its prompt) is more than {ckey!r} "
            f"allows in a minute (tokens_per_minute {rate.tpm}): it could never run; lower max_tokens",
            key=ckey, estimate=estimate, limit=rate.tpm,
        )
    limits = {
        "ckey": ckey,
        "rate_limit": rate,
        "estimate": estimate,
        "queue_size": settings.queue_size_for("llm"),
        "concurrency": settings.concurrency_for("llm"),
        "max_attempts": opts.max_attempts or settings.workers.max_attempts,
        "timeout": float(opts.timeout or model_cfg.timeout),
        **fair_limits(env, settings, -1 if per_key is None else per_key),
    }
    return env, limits


# -- cancelling a call that no worker has taken -------------------------------------------------

CANCEL_FIELDS = (
    keys.F_STATE, keys.F_ATTEMPT, keys.F_TRACE, keys.F_KIND, keys.F_TOOL, keys.F_CHANNEL, keys.F_CKEY, "origin",
    keys.F_SESSION, "data",
)
PENDING_CANCEL = {"type": "cancelled", "message": "cancelled by the caller before it started"}
RETRYING_CANCEL = {"type": "cancelled", "message": "cancelled by the caller while it waited for its next attempt"}


@dataclass(frozen=True)
class CancelTarget:
    """A call as cancel reads it (``CANCEL_FIELDS``)."""

    info: CallInfo
    state: str
    attempt: int
    data: Any

    @classmethod
    def of(cls, call_id: str, raw: Sequence[Any]) -> CancelTarget | None:
        """From ``HMGET job CANCEL_FIELDS``; None for a call not on record."""
        if raw[0] is None:
            return None
        state, attempt, trace, kind, tool, chan, ckey, origin, session = (text(v) if v is not None else "" for v in raw[:-1])
        info = CallInfo(call_id, trace, new_span_id(), kind, tool, session or None, chan, ckey, origin)
        return cls(info, state, int(attempt or 1), raw[-1])

    def audit_record(self, sensitive: Any, error: dict[str, str], digest: Any = None) -> Any:
        """The audit record of the call cancelled while no worker held it (pending, or between attempts:
        ``error`` says which); ``digest``: the audit log's keyed hash (None: sensitive args masked only)."""
        from broker.audit import AuditRecord, context_fields
        from broker.calls import envelope_of

        info = self.info
        try:
            env = envelope_of(self.data) if self.data else None
        except HermesError:
            env = None
        context = env.context if env is not None else {}
        return AuditRecord.of(
            call_id=info.call_id, kind=info.kind, state=str(State.CANCELLED),
            args=env.args if env is not None else None, sensitive=tuple(sensitive or ()),
            request=env.request if env is not None and info.kind == "llm" else None, error=error,
            tool_name=info.name if info.kind == "tool" else None,
            model=info.name if info.kind == "llm" else None, **context_fields(context),
            trace_id=info.trace_id, attempts=self.attempt, digest=digest,
        )


# -- one operation for both faces -------------------------------------------------------------

T = TypeVar("T")
# An operation written once for both faces: it yields what each Redis command returned (the reply on the
# threaded client, an awaitable of it on the asyncio one) and is sent back the reply (``run_steps``,
# ``await_steps``), or has the error raised where it yielded.
Steps = Generator[Any, Any, T]


def run_steps(steps: Steps[T]) -> T:
    """Run ``steps`` on the threaded client: each command was sent as it was yielded; its reply goes back."""
    reply: Any = None
    while True:
        try:
            reply = steps.send(reply)
        except StopIteration as end:
            return cast(T, end.value)


async def await_steps(steps: Steps[T]) -> T:
    """Run ``steps`` on the asyncio client: each awaitable yielded is awaited; its result goes back, or its
    error is raised inside ``steps``."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as end:
            return cast(T, end.value)
        reply = error = None
        try:
            reply = (await step) if inspect.isawaitable(step) else step
        except BaseException as e:  # (raised inside ``steps``, where it may be handled)
            error = e


# -- events and handles --------------------------------------------------------------------------

LIVE_GRACE = 0.2  # seconds a follower waits for live events an ended call's history no longer holds (``sync``)


class CallState:
    """What a handle knows of its call: its events, its end, its result or error, or the refusal of its
    submission; the faces add waiting. ``lock``: held while the state changes."""

    def __init__(self, router: Router[Any], call_id: str, name: str, kind: str = "tool", *, own: bool = True,
                 lock: Any = None) -> None:
        self.router = router
        self.call_id = call_id
        self.name = name
        self.kind = kind
        self.own = own  # events arrive on our channel (False: someone else's call, followed from Redis)
        self.refused: HermesError | None = None
        self.abandoned: HermesError | None = None  # its client closed while it ran: the wait ends, not the call
        self._events: list[Event] = []
        self._final: Event | None = None
        self._lock = lock if lock is not None else contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.call_id} {self.state}>"

    @property
    def last_seq(self) -> int:
        return self._events[-1].seq if self._events else 0

    @property
    def seen(self) -> list[Event]:
        """The events of the call seen so far, in seq order (a copy)."""
        with self._lock:
            return list(self._events)

    @property
    def state(self) -> str:
        if self.refused is not None:
            return "refused"
        for event in reversed(self._events):
            if event.type == ev_mod.TRANSITION:
                return event.state
        return str(State.PENDING)

    @property
    def final_state(self) -> str | None:
        return self._final.state if self._final else None

    @property
    def final(self) -> Event | None:
        """The call's terminal event, once it has ended."""
        return self._final

    @property
    def trace_id(self) -> str:
        return self._events[0].trace_id if self._events else ""

    def done(self) -> bool:
        return self._final is not None or self.refused is not None

    def settled(self) -> bool:
        """Nothing more to wait for: it ended, was refused, or its client closed (``abandoned``: the call
        itself goes on, so ``done()`` stays False and a cancel still reaches it)."""
        return self.done() or self.abandoned is not None

    def feed(self, event: Event) -> None:
        """Take one event of the call (one already seen is ignored); at its end the router stops routing."""
        with self._lock:
            if event.seq <= self.last_seq:
                return
            if event.terminal and event.seq > self.last_seq + 1:  # (a trimmed history: the end alone)
                moved = sum(e.type == ev_mod.TRANSITION for e in self._events)
                self._events.extend(ev_mod.missed_moves(event, self.last_seq, moved))
            self._events.append(event)
            if event.terminal:
                self._final = event
            self._changed(event)
        if event.terminal and self.own:  # however the end was seen (pub/sub or a history read)
            self.router.ended(self)

    def refuse(self, error: HermesError) -> None:
        """The submission of the call failed with ``error`` (``result()`` raises it)."""
        with self._lock:
            self.refused = error
            self._changed(None)

    def abandon(self, error: HermesError) -> None:
        """Its client closed: ``result()`` raises ``error`` (the call itself goes on)."""
        with self._lock:
            self.abandoned = error
            self._changed(None)

    def _changed(self, event: Event | None) -> None:
        """Called under the lock when an event arrives (None: refused); the faces wake their waiters."""

    def sync(self, live_grace: float = 0.0) -> Any:
        """Fetch the events not seen yet from the call's durable history (the faces')."""
        raise NotImplementedError

    def _outcome(self, conn: Any) -> Steps[Any]:
        """``outcome``, with a result too large for the terminal event read from the call's record (at each
        read, not kept: the asyncio client keeps ended calls' handles, and ``serve`` would hold megabytes each)."""
        final = self._final
        if final is not None and final.state == State.DONE and "result" not in final.detail:
            raw = yield conn.hget(keys.job(self.call_id), keys.F_RESULT)
            return unpack(raw) if raw is not None else None
        return self.outcome()

    def outcome(self) -> Any:
        """The result of the ended call; raises the refusal, its typed error, or CallCancelled."""
        if self.refused is not None:
            raise self.refused
        final = self._final
        if final is None and self.abandoned is not None:
            raise self.abandoned
        assert final is not None
        if final.state == State.DONE:
            return final.detail.get("result")
        error = final.detail.get("error") or {}
        if final.state == State.CANCELLED:
            raise CallCancelled(error.get("message") or f"call {self.call_id} was cancelled")
        raise error_from_wire(error)


H = TypeVar("H", bound=CallState)


class Router(Generic[H]):
    """A client's handles by call id, from submission to end; with ``keep_ended`` the latest ended ones
    stay findable by ``get``."""

    def __init__(self, keep_ended: int = 0) -> None:
        self.handles: dict[str, H] = {}
        self.keep_ended = keep_ended
        self._ended: OrderedDict[str, H] = OrderedDict()
        self._ended_events = 0  # held by the handles in _ended
        self._lock = threading.Lock()

    def track(self, handle: H) -> H:
        with self._lock:
            self.handles[handle.call_id] = handle
        return handle

    def drop(self, call_id: str, handle: H | None = None) -> None:
        """Stop routing to ``call_id`` (only if it is still ``handle``, when one is given)."""
        with self._lock:
            if handle is None or self.handles.get(call_id) is handle:
                self.handles.pop(call_id, None)

    def ended(self, handle: H) -> None:
        """``handle``'s call ended: it is fed no more (and kept a while with ``keep_ended``)."""
        with self._lock:
            if self.handles.get(handle.call_id) is not handle:
                return
            del self.handles[handle.call_id]
            if self.keep_ended:  # (an ended call keeps its terminal event alone in Redis)
                self._ended[handle.call_id] = handle
                self._ended_events += len(handle._events)
                while len(self._ended) > self.keep_ended or self._ended_events > ENDED_EVENTS_KEPT:
                    self._ended_events -= len(self._ended.popitem(last=False)[1]._events)

    def get(self, call_id: str) -> H | None:
        """The handle routed to, or kept after its end, for ``call_id``."""
        return self.handles.get(call_id) or self._ended.get(call_id)

    def waiting(self) -> list[H]:
        """The handles whose calls have not ended."""
        with self._lock:
            return [h for h in self.handles.values() if not h.done()]

    @staticmethod
    def read_history(pipe: Any, handles: Sequence[CallState]) -> None:
        """Queue on ``pipe`` the reads of each handle's unseen history; ``feed_history`` takes the replies."""
        for h in handles:
            pipe.lrange(keys.history(h.call_id), h.last_seq, -1)
            pipe.get(keys.ended(h.call_id))

    @staticmethod
    def feed_history(handles: Sequence[CallState], stored: Sequence[Any]) -> None:
        for i, h in enumerate(handles):
            for event in ev_mod.unseen(stored[2 * i], stored[2 * i + 1], h.last_seq, h.call_id):
                h.feed(event)


class Handles(list[H]):
    """The handles of a batch, in submission order; ``accepted`` and ``refused`` split them."""

    @property
    def accepted(self) -> list[H]:
        return [h for h in self if h.refused is None]

    @property
    def refused(self) -> list[tuple[int, H]]:
        """(index in the batch, handle) of each refused item; ``handle.refused`` is its error."""
        return [(i, h) for i, h in enumerate(self) if h.refused is not None]


# -- the operations both faces run ---------------------------------------------------------------

CATCH_UP_CHUNK = 500  # history reads per pipelined round trip when the subscription comes back


class ClientCore(Generic[H]):
    """What ``Gateway`` and ``AsyncGateway`` share: their channel, their calls in flight (``router``), the
    subscription's reconnects, and submitting, settling, cancelling, looking up and catching up as ``Steps``.
    A face runs them with ``run_steps`` or ``await_steps`` and provides the methods below that raise
    NotImplementedError here (each returns its result, or an awaitable of it)."""

    def __init__(self, conn: Any, settings: Settings, keep_ended: int = 0) -> None:
        durability.check_supported(conn, settings)
        self.conn = conn
        self.settings = settings
        self.client_id = uuid.uuid4().hex
        self.channel = keys.caller_channel(self.client_id)
        self.cluster = is_cluster(conn)
        self._channels = {self.channel}  # (on a cluster, one sharded channel per queue tag used too)
        self.calls = Calls(conn)
        self.calls.keep_history = settings.workers.keep_history
        self.router: Router[H] = Router(keep_ended)
        self._tools_channel = keys.channel(conn, keys.TOOLS_CHANNEL).encode()
        self._pubsub = subscriber(conn)
        self._catch_up_due = False  # (set on a reconnect of the subscription: see ``_watch_reconnects``)
        self.shut = False  # close() began: nothing more is sent

    def shutting(self) -> None:
        """The face's close() begins: refuse new calls, and end the waits of the calls in flight (a waiter
        would otherwise poll a closed connection, which redis-py quietly opens again, or wait forever)."""
        self.shut = True
        for handle in self.router.waiting():
            handle.abandon(GatewayClosed(
                f"the gateway was closed while call {handle.call_id} ({handle.name}) was in flight: it goes on "
                "without this client (read its outcome by id with another)", call_id=handle.call_id,
            ))

    def _check_open(self) -> None:
        if self.shut:
            raise GatewayClosed("this gateway was closed: it sends no more calls (connect a new one)")

    def tool(self, name: str) -> Any:
        raise NotImplementedError

    def channel_for(self, queue: str) -> str:
        raise NotImplementedError

    def _new_handle(self, call_id: str, name: str, kind: str = "tool", *, own: bool = True) -> H:
        raise NotImplementedError

    def _read_histories(self, handles: Sequence[H]) -> Steps[None]:
        """Feed ``handles`` their history so far, in one round trip. A broker failing meanwhile is no
        failure of theirs: a handle waited on reads its history again now and then."""
        if not handles:
            return
        pipe = self.conn.pipeline(transaction=False)
        Router.read_history(pipe, handles)
        try:
            Router.feed_history(handles, (yield pipe.execute()))
        except (redis.RedisError, OSError, DecodeError) as e:
            log.warning("could not read the history of existing calls", calls=len(handles), error=str(e))

    def _ensure_workers(self, queues: Iterable[str]) -> Any:
        raise NotImplementedError

    def _send_chunk(self, chunk: list[tuple[Envelope, dict[str, Any], H]]) -> Any:
        """The SUBMIT replies of ``chunk`` (an error in place of a failed one), and WAIT's (None when not
        asked for): ``pipelined``."""
        raise NotImplementedError

    def _patient(self, pipe: Any) -> Any:
        """``pipe``'s replies (an error in place of a failed command); what a moving cluster slot refused did
        not run, and is sent again for up to ``pipes.SUBMIT_PATIENCE``."""
        raise NotImplementedError

    def _watch_reconnects(self) -> None:
        """redis-py subscribes again on every reconnect (its connect callback); ours, called after it, has
        every waiting handle read its history (``_catch_up``): what was published meanwhile is lost."""
        connection = getattr(self._pubsub, "connection", None)
        if connection is not None and hasattr(connection, "register_connect_callback"):
            connection.register_connect_callback(self._on_reconnect)

    def _on_reconnect(self, connection: Any) -> None:
        self._catch_up_due = True

    def _call_tool(self, name: str, args: dict[str, Any] | None, opts: CallOptions, context: dict[str, Any]) -> Steps[H]:
        with answered(f"submitting a call of {name!r}"), Sending(opts.traceparent, opts.tracestate) as send:
            entry = yield self.tool(name)
            opts = dataclasses.replace(opts, trace_headers=send.headers)
            env = tool_envelope(entry, name, args, opts, context, self.channel_for, self.settings)
            send.describe(env)
            return (yield from self._submit(env, tool_limits(env, entry.spec, self.settings)))

    def _call_llm(self, request: dict[str, Any], opts: CallOptions, context: dict[str, Any]) -> Steps[H]:
        check_llm_request(request, context)  # before the producer span starts
        send = Sending(opts.traceparent, opts.tracestate)
        opts = dataclasses.replace(opts, trace_headers=send.headers)
        env, limits = llm_envelope(request, self.settings, opts, context, self.channel_for)
        with answered("submitting an LLM call"), send:
            send.describe(env)
            return (yield from self._submit(env, limits))

    def _submit(self, env: Envelope, limits: dict[str, Any]) -> Steps[H]:
        self._check_open()
        yield self._ensure_workers((env.queue,))
        handle = self.router.track(self._new_handle(env.call_id, env.name, env.kind))
        try:
            (reply,), acked = yield self._send_chunk([(env, limits, handle)])
            if isinstance(reply, Exception):
                raise reply
            settled = yield from self._settle(env, limits, handle, reply, acked)
            if settled is not handle:  # (an idempotent resubmission: the existing call, with its history)
                yield from self._read_histories([settled])
            return settled
        except BaseException:
            self.router.drop(env.call_id)
            raise

    def _submit_many(self, calls: Iterable[tuple[str, dict[str, Any]]], common: dict[str, Any], handles: Handles[H],
                     chunk_size: int) -> Steps[Handles[H]]:
        """Submit (tool, args) pairs into ``handles``: every item is checked, its tool looked up first, before
        anything is sent, then they go in pipelines of ``chunk_size``. A broker failure on the first pipeline
        raises; on a later one, its items are refused as "outcome unknown", the rest as not sent."""
        self._check_open()
        opts = CallOptions.take(common)
        idem_keys: Sequence[str | None] | None = common.pop("idempotency_keys", None)
        calls = list(calls)
        check_batch_keys(common, idem_keys, len(calls))
        entries = {}
        for name in dict.fromkeys(n for n, _ in calls):  # (UnknownTool before anything else)
            entries[name] = yield self.tool(name)
        send = Sending(opts.traceparent, opts.tracestate)  # one producer span for the batch
        opts = dataclasses.replace(opts, trace_headers=send.headers)
        prepared: list[tuple[Envelope, dict[str, Any], H]] = []
        try:
            for i, (name, args) in enumerate(calls):
                entry = entries[name]
                env = tool_envelope(entry, name, args, opts.item(idem_keys, i), common, self.channel_for, self.settings)
                handle = self.router.track(self._new_handle(env.call_id, name))
                prepared.append((env, tool_limits(env, entry.spec, self.settings), handle))
            yield self._ensure_workers(env.queue for env, _, _ in prepared)
            with send:
                send.describe(prepared[0][0] if prepared else None, len(prepared))
                failure: redis.RedisError | None = None
                for start in range(0, len(prepared), chunk_size):
                    chunk = prepared[start : start + chunk_size]
                    replies: list[Any]
                    acked: Any = None
                    if failure is not None:  # the broker failed on an earlier pipeline: do not wait on it again
                        replies = [HermesError(f"not sent: the broker failed earlier in this batch: {failure}")]
                        replies *= len(chunk)
                    else:
                        try:
                            replies, acked = yield self._send_chunk(chunk)
                        except redis.RedisError as e:
                            if start == 0:
                                raise
                            failure = e
                            # The server may have taken some of this pipeline before the connection broke.
                            unknown = HermesError(
                                f"submission outcome unknown: {e}; gw.handle(call_id) finds the call if it was taken"
                            )
                            replies = [unknown] * len(chunk)
                    existing: list[H] = []  # (idempotent resubmissions: their histories read together)
                    for (env, limits, handle), reply in zip(chunk, replies, strict=True):
                        try:
                            if isinstance(reply, Exception):
                                raise reply if isinstance(reply, HermesError) else broker_error("submission failed", reply)
                            settled = yield from self._settle(env, limits, handle, reply, acked)
                            if settled is not handle:  # (the existing call)
                                existing.append(settled)
                            handle = settled
                        except HermesError as e:
                            self.router.drop(env.call_id)
                            handle.refuse(e)
                        handles.append(handle)
                    yield from self._read_histories(existing)
        except BaseException:
            for env, _, _ in prepared[len(handles) :]:  # (those not settled yet)
                self.router.drop(env.call_id)
            raise
        return handles

    def pipelined(self, chunk: Sequence[tuple[Envelope, dict[str, Any], Any]],
                   execute: Callable[[Any], Any]) -> Steps[tuple[list[Any], Any]]:
        """SUBMIT ``chunk``'s calls (envelope, SUBMIT's keywords, anything) in one pipeline sent by
        ``execute``: their replies (an error in place of a failed one), and WAIT's (None when not asked for)."""
        pipe = self.conn.pipeline(transaction=False)
        for env, limits, _ in chunk:
            yield self.calls.submit(env, pipeline=pipe, **limits)
        confirm = bool(chunk) and durability.queue_wait(pipe, self.settings)  # (before the wake-up: workers see it confirmed)
        queues = list(dict.fromkeys(keys.base_queue(env.queue) for env, _, _ in chunk))
        yield from self._wake(pipe, queues)
        replies = yield execute(pipe)
        yield from self._wake(None, queues)
        return replies[: len(chunk)], replies[len(chunk)] if confirm else None

    def _wake(self, pipe: Any, queues: Iterable[str]) -> Steps[None]:
        """Wake the workers of ``queues``: in the submission's pipeline on a plain Redis (``pipe``), after
        it on a cluster (``pipe`` None; a cluster pipeline carries no PUBLISH)."""
        if (pipe is None) != self.cluster:
            return
        for queue in queues:
            channel = self.calls.wake_channel(queue)
            if pipe is not None:
                pipe.publish(channel, b"")
            else:
                yield self.conn.publish(channel, b"")

    def _settle(self, env: Envelope, limits: dict[str, Any], handle: H, reply: Any, acked: Any) -> Steps[H]:
        """The handle of a submitted call from SUBMIT's reply (and WAIT's, ``acked``, when confirmations
        are asked for): that of the existing call for an idempotent resubmission (its history is for the
        caller to read: ``_read_histories``); raises its refusal, or BrokerNotDurable, the call cancelled,
        when WAIT confirmed it on too few replicas."""
        _, call_id = Calls.check_submit(reply, limits["ckey"], limits["queue_size"], env)
        if call_id != env.call_id:  # idempotent resubmission: follow the call that already exists
            self.router.drop(env.call_id)
            name, kind = Calls.existing_call(reply) or (env.name, env.kind)
            return self._new_handle(call_id, name, kind, own=False)
        what = f"call {env.call_id} ({env.name}) not accepted"
        error = None if acked is None else durability.shortfall(acked, self.settings, what, call_id=env.call_id)
        if error is not None:
            try:
                error.details["cancelled"] = yield from self._cancel(env.call_id)
            except (redis.RedisError, OSError) as e:  # the broker failed meanwhile: the caller is told it may still run
                error.details["cancelled"] = False
                error.message += f"; cancelling it failed too ({e}): gw.handle({env.call_id!r}) finds it if it was kept"
            raise error
        return handle

    def _cancel(self, call_id: str) -> Steps[bool]:
        """Cancel by id; True when the request was recorded (the call was not already finished). A call no
        worker has taken ends here (with its audit record); a leased one's worker is told to stop it."""
        conn = self.conn
        target = CancelTarget.of(call_id, (yield conn.hmget(keys.job(call_id), *CANCEL_FIELDS)))
        if target is None or target.state in TERMINAL:
            return False
        info = target.info
        retrying = target.state == State.RETRYING  # (between attempts: no worker holds it either)
        if retrying or (target.state == State.PENDING
                        and (yield conn.zscore(keys.leases(keys.tag(info.queue)), call_id)) is None):
            error = RETRYING_CANCEL if retrying else PENDING_CANCEL
            pipe = conn.pipeline(transaction=False)
            yield self.calls.cancel_unleased(info, attempt=target.attempt, error=error, retrying=retrying,
                                             pipeline=pipe)
            (reply,) = yield self._patient(pipe)  # (a moving slot is waited out, as a submission's)
            if isinstance(reply, Exception):
                raise reply
            if int(reply[0]) > 0:
                from broker.audit import AuditLog
                from broker.logs import keyed_hash

                sensitive: tuple[str, ...] = ()
                if info.kind == "tool":
                    with contextlib.suppress(HermesError):  # removed meanwhile: still redacted by name
                        sensitive = (yield self.tool(info.name)).spec.sensitive
                audit = AuditLog.from_settings(conn, self.settings.audit)
                secret = yield conn.get(audit.hash_key)  # (AuditLog.digest's; a worker made it)
                yield audit.append(target.audit_record(sensitive, error, keyed_hash(secret) if secret else None))
                shown = info.kind not in keys.STATS_CAPPED or int((yield stats_name(conn, info.kind, info.name)))
                name = info.name if shown else keys.STATS_OTHER
                yield conn.hincrby(keys.STATS, keys.stats_ended(info.kind, name, "cancelled", error["type"]), 1)
                return True
        yield conn.hset(keys.job(call_id), keys.F_CANCEL, "1")
        yield conn.publish(keys.channel(conn, keys.CONTROL_CHANNEL), pack({"op": "cancel", "call_id": call_id}))
        return True

    def _lookup(self, call_id: str) -> Steps[H]:
        """A handle on any call by id: one of ours still running is the handle the events already feed;
        another is read from its record, with its history so far (``own``: its events come on our
        channel, and it is fed them from now on)."""
        tracked = self.router.get(call_id)
        if tracked is not None:
            return tracked
        raw = yield self.conn.hmget(keys.job(call_id), keys.F_TOOL, keys.F_KIND, keys.F_CHANNEL)
        if raw[1] is None:
            raise CallFailed(f"no such call {call_id}", error_type="unknown_call")
        name, kind, channel = (text(v) if v is not None else "" for v in raw)
        handle = self._new_handle(call_id, name, kind, own=channel in self._channels)
        if handle.own:
            self.router.track(handle)
        try:
            yield handle.sync()  # (an ended call is untracked again by its terminal event)
        except BaseException:
            self.router.drop(call_id, handle)
            raise
        return handle

    @staticmethod
    def _fill_gap(handle: H, event: Event) -> Steps[bool]:
        """Read the events a handle missed before ``event`` from the history; whether to feed ``event``
        now. When the read fails, a terminal event still is (its end is known, and the moves it names
        are listed), another is not: the handle's next re-read lists it after the ones it missed."""
        try:
            yield handle.sync()
        except (redis.RedisError, OSError, DecodeError) as e:
            log.warning("could not fill an event gap from the history", error=str(e))
            return event.terminal
        return True

    def _catch_up(self) -> Steps[None]:
        """Read the durable history of every call still waited on, in pipelined round trips (when the
        subscription comes back: what was published meanwhile is lost). Raises the broker's error."""
        pending = self.router.waiting()
        for start in range(0, len(pending), CATCH_UP_CHUNK):
            chunk = pending[start : start + CATCH_UP_CHUNK]
            pipe = self.conn.pipeline(transaction=False)
            self.router.read_history(pipe, chunk)
            self.router.feed_history(chunk, (yield pipe.execute()))
