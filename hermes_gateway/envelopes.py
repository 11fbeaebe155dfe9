"""What a client submits: the envelope of a tool or LLM call and its admission limits (pure, no I/O).

The threaded ``Gateway`` and the asyncio ``AsyncGateway`` both build their calls here, so the two
clients cannot drift apart on context fields, trace headers, queues or limits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from broker import keys, partitions
from broker.codec import pack
from broker.config import MAX_ARGS_ENV, Settings
from broker.directory import Entry
from broker.envelope import (
    CALL_CLASSES,
    CONTEXT_FIELDS,
    Envelope,
    Options,
    concurrency_key,
    fairness_of,
    new_call_id,
)
from broker.errors import InvalidArgs, TokensOverLimit
from broker.ratelimits import RateLimit, estimate_tokens
from broker.toolspec import ToolSpec
from broker.tracecontext import ensure_traceparent
from hermes_gateway.telemetry import Headers, current_headers

MAX_FAIRNESS_KEY = 256  # characters of a fairness key (it is a field of a hash in Redis)
MAX_DEPTH = 100  # levels of nesting a call's arguments may have (a tool's arguments rarely pass 10)


def nesting(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply ``value`` nests lists and mappings, counted up to ``limit + 1`` (walked without recursion:
    the point is to refuse what would exhaust the recursion of the code that handles it later)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        depth += 1
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children if isinstance(child, dict | list | tuple))
    return deepest


def check_sendable(value: Any, what: str, limit: int | None = None) -> bytes:
    """``value`` packed (the envelope keeps these bytes: the job is not packed again), or a typed error now
    for a value the wire cannot carry (a Decimal, an arbitrary object), not a bare TypeError from deep in
    the submission; with ``limit``, for one larger than that many bytes packed. Nesting deeper than
    ``MAX_DEPTH`` is refused too: validation, redaction and the executors recurse."""
    if nesting(value) > MAX_DEPTH:
        raise InvalidArgs(f"{what} are nested more than {MAX_DEPTH} levels deep", limit=MAX_DEPTH)
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


def call_options(opts: dict[str, Any]) -> Options:
    """The envelope's options from a client's keyword options, with a typed error for a bad fairness key
    or class (``call_class``: ``interactive`` or ``batch``)."""
    fkey, klass = opts.get("fairness_key"), opts.get("call_class")
    if fkey is not None and (not isinstance(fkey, str) or not fkey or len(fkey) > MAX_FAIRNESS_KEY):
        raise InvalidArgs(f"fairness_key must be a non-empty string of at most {MAX_FAIRNESS_KEY} characters, got {fkey!r}")
    if klass is not None and klass not in CALL_CLASSES:
        raise InvalidArgs(f"call_class must be one of {', '.join(CALL_CLASSES)}, got {klass!r}")
    return Options(
        timeout=opts.get("timeout"),
        idempotency_key=opts.get("idempotency_key"),
        max_attempts=opts.get("max_attempts"),
        fairness_key=fkey,
        call_class=klass,
    )


def check_context(context: dict[str, Any]) -> None:
    """Refuse call-context fields the envelope does not know (a typo would otherwise vanish)."""
    unknown = set(context) - set(CONTEXT_FIELDS)
    if unknown:
        known = ", ".join(CONTEXT_FIELDS)
        raise TypeError(f"unknown call context field(s): {', '.join(sorted(unknown))}; known: {known}")


def check_llm_request(request: Any, context: dict[str, Any]) -> None:
    """Refuse an LLM request that is not a mapping, or unknown context fields."""
    if not isinstance(request, dict):
        raise InvalidArgs(f"an LLM request must be a mapping, got {type(request).__name__}")
    check_context(context)


def tool_envelope(
    entry: Entry,
    name: str,
    args: dict[str, Any] | None,
    opts: dict[str, Any],
    context: dict[str, Any],
    channel: Callable[[str], str],
    settings: Settings | None = None,
) -> Envelope:
    """The envelope of one call of the directory tool ``entry``; events go to ``channel(queue)``. A tool
    split in partitions (``queue_partitions``) gets the next partition with a share of its limit;
    arguments larger than ``settings.broker.max_args`` packed are refused."""
    spec = entry.spec
    check_context(context)
    if args is not None and not isinstance(args, dict):
        raise InvalidArgs(f"arguments for {name!r} must be a mapping, got {type(args).__name__}")
    limit = settings.broker.max_args if settings is not None else None
    args = args or {}
    packed = check_sendable(args, f"arguments for {name!r}", limit)
    # The producer span's context when tracing is on (Sending), else the caller's own or the current one.
    tp, ts, bg = opts.get("trace_headers") or (opts.get("traceparent"), opts.get("tracestate"), None)
    if tp is None:
        tp, ts, bg = current_headers()
    queue = opts.get("queue") or str(spec.config.get("queue") or "tools")
    n = partitions.count(spec)
    if n > 1:
        concurrency = spec.concurrency or (settings.concurrency_for(spec.executor) if settings else -1)
        queue = partitions.route(queue, n, concurrency, opts.get("idempotency_key"), opts.get("partition_slot"))
    env = Envelope(
        call_id=keys.call_id(queue, opts.get("call_id") or new_call_id()),
        kind="tool",
        tool=name,
        args=args,
        tool_version=entry.version,
        context={k: v for k, v in context.items() if v is not None},
        traceparent=ensure_traceparent(tp),
        tracestate=ts,
        baggage=bg,
        options=call_options(opts),
        queue=queue,
        channel=channel(queue),
    )
    return env.keep_packed(packed)


def tool_limits(env: Envelope, spec: ToolSpec, settings: Settings) -> dict[str, Any]:
    """Admission limits of a tool call: concurrency key and limit, queue size, attempts, timeout."""
    queue_size = spec.queue_size
    if queue_size is None:
        queue_size = settings.queue_size_for(spec.executor)
    # Error retries (``retry.max``) need their attempts too; an explicit per-call max_attempts wins.
    retries = int((spec.retry or {}).get("max") or 0)
    concurrency = spec.concurrency or settings.concurrency_for(spec.executor)
    # A partition's share of the tool's limit and queue size (the shares add up to them exactly).
    # (so is the per-key bound: a key's calls go to the partitions in turn)
    n = partitions.count(spec)
    per_key = settings.fairness.queue_size_per_key
    key_size = -1 if per_key is None else partitions.limits(env.queue, n, concurrency, per_key)[1]
    concurrency, queue_size = partitions.limits(env.queue, n, concurrency, queue_size)
    rate = RateLimit.parse(f"tool {spec.name!r}", spec.config.get("rate_limit"))
    if rate is not None and n > 1:
        rate = rate.share(n, partitions.index(env.queue))
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
    """What SUBMIT needs for the call's fair turn: its key's weight, the batch share, the per-key bound
    (``key_size``, -1 = none)."""
    fairness = settings.fairness
    return {
        "weight": fairness.weight_of(env.context.get("principal"), fairness_of(env)[0]),
        "batch_share": fairness.batch_share,
        "key_size": key_size,
    }


def llm_envelope(
    request: dict[str, Any],
    settings: Settings,
    opts: dict[str, Any],
    context: dict[str, Any],
    channel: Callable[[str], str],
    headers: Headers,
) -> tuple[Envelope, dict[str, Any]]:
    """The envelope and limits of one LLM call (chat-completions kwargs) on ``opts["queue"]``."""
    check_llm_request(request, context)
    packed = check_sendable(request, "the LLM request", settings.broker.max_args)
    context = dict(context)
    model_cfg = settings.model
    context.setdefault("provider", model_cfg.provider or "openai-compatible")
    context.setdefault("api_mode", model_cfg.api_mode or "chat_completions")
    context["model"] = request.get("model") or context.get("model") or model_cfg.model or None
    tp, ts, bg = headers
    timeout, max_attempts = opts.get("timeout"), opts.get("max_attempts")
    per_key = settings.fairness.queue_size_per_key
    queue = opts.get("queue") or "llm"
    env = Envelope(
        call_id=keys.call_id(queue, new_call_id()),
        kind="llm",
        request=request,
        context={k: v for k, v in context.items() if v is not None},
        traceparent=ensure_traceparent(tp),
        tracestate=ts,
        baggage=bg,
        options=call_options(opts),
        queue=queue,
        channel=channel(queue),
    ).keep_packed(packed)
    ckey = concurrency_key(env)
    rate = model_cfg.rate_limit_for(str(context["provider"]), str(context.get("model") or ""))
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
        "max_attempts": max_attempts or settings.workers.max_attempts,
        "timeout": float(timeout or model_cfg.timeout),
        **fair_limits(env, settings, -1 if per_key is None else per_key),
    }
    return env, limits


def check_batch_keys(common: dict[str, Any], idem_keys: Sequence[str | None] | None, n: int | None = None) -> None:
    """A batch takes one idempotency key (or None) per item, never one key for all of them; ``n`` items."""
    if "idempotency_key" in common or isinstance(idem_keys, str | bytes):
        raise TypeError("map/submit_many take idempotency_keys= (one key or None per item), not one key")
    if idem_keys is not None and n is not None and len(idem_keys) != n:
        raise ValueError(f"idempotency_keys has {len(idem_keys)} entries for {n} calls")


def item_opts(opts: dict[str, Any], idem_keys: Sequence[str | None] | None, i: int) -> dict[str, Any]:
    """The options of batch item ``i``: ``opts`` with its idempotency key, if it has one."""
    if idem_keys is None or i >= len(idem_keys) or idem_keys[i] is None:
        return opts
    return {**opts, "idempotency_key": idem_keys[i]}
