"""The Gateway client: submit tool and LLM calls, follow their events, get typed results."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis
import structlog

from broker import durability, keys, partitions, pipes
from broker.calls import Calls
from broker.config import Settings, load_settings
from broker.connection import BrokerHandle, answered, broker_error, connect, is_cluster, subscriber
from broker.directory import Directory, Entry
from broker.envelope import Envelope
from broker.errors import HermesError, InvalidSpec, QueueFull
from broker.toolspec import ToolSpec
from hermes_gateway.client_events import ClientEvents
from hermes_gateway.client_workers import ClientWorkers
from hermes_gateway.envelopes import (
    check_batch_keys,
    check_llm_request,
    item_opts,
    llm_envelope,
    tool_envelope,
    tool_limits,
)
from hermes_gateway.handle import Batch, CallHandle, cancel_call
from hermes_gateway.telemetry import Sending

if TYPE_CHECKING:
    from hermes_gateway.batches import BatchJob

log = structlog.get_logger("hermes.client")

SUBMIT_CHUNK = 100  # calls per pipelined round trip in submit_many


def find_broker(settings: Settings, url: str | None = None, *, embedded_ok: bool = True) -> BrokerHandle:
    """The broker of a client (``Gateway.connect`` and ``AsyncGateway.connect`` alike), as the commands find
    theirs: ``url`` / ``$HERMES_REDIS_URL`` / ``broker.url``; else the embedded broker of the ``serve`` or
    ``worker`` of the same ``$HERMES_HOME`` running here; else (``embedded_ok``) an embedded broker of its own."""
    url = url or settings.broker.url
    if url is None and embedded_ok:
        from hermes_gateway.local import connect_local

        return connect_local(settings)[0]
    return connect(url, embedded_ok=embedded_ok)


def register_dir(directory: Directory, path: Any, errors: list[InvalidSpec] | None = None) -> list[tuple[str, int, bool]]:
    """Register every spec file of ``path`` in ``directory`` (``sync_tools`` of both clients); a file that
    does not load is skipped: it goes to ``errors`` when given, else it is logged as a warning."""
    from pathlib import Path

    from workers.specs import sync_dir

    bad: list[InvalidSpec] = [] if errors is None else errors
    done = sync_dir(directory, Path(path), bad)
    if errors is None:
        for e in bad:
            log.warning("tool spec skipped", error=str(e))
    return done


class Gateway(ClientEvents, ClientWorkers):
    """A client of the gateway: one connection, one event channel, many calls in flight."""

    def __init__(
        self, handle: BrokerHandle, settings: Settings | None = None, *, check_workers: bool = False
    ) -> None:
        self.broker = handle
        # Refuse a call at once (NoWorkers) when no worker listens on its queue; on an embedded broker of
        # our own, start a worker for the queue instead (it ends with this gateway).
        self.check_workers = check_workers
        self._workers_seen: dict[str, float] = {}  # queue -> until when a seen worker is trusted
        self._own_workers: list[Any] = []
        self._workers_lock = threading.Lock()  # (two threads' first calls start one worker, not two)
        self.conn: redis.Redis = handle.conn
        self.settings = settings or load_settings()
        durability.check_supported(self.conn, self.settings)
        self.client_id = uuid.uuid4().hex
        self.channel = keys.caller_channel(self.client_id)
        pipes.configure(self.settings.broker.fast_path)
        self.calls = Calls(self.conn)
        self.calls.keep_history = self.settings.workers.keep_history
        self.directory = Directory(self.conn)
        self._handles: dict[str, CallHandle] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # On a cluster, events come on one sharded channel per queue tag used (``channel_for``).
        self.cluster = is_cluster(self.conn)
        self._channels = {self.channel}
        self._confirmed: dict[str, threading.Event] = {}
        self._sub_lock = threading.Lock()
        self._pubsub = subscriber(self.conn)
        self._tools_channel = keys.channel(self.conn, keys.TOOLS_CHANNEL).encode()
        self._pubsub.subscribe(self._tools_channel, *([] if self.cluster else [self.channel]))
        # redis-py subscribes again on every reconnect; then every waiting handle reads its history at once.
        self._catch_up_due = False
        connection = getattr(self._pubsub, "connection", None)
        if connection is not None and hasattr(connection, "register_connect_callback"):
            connection.register_connect_callback(self._on_reconnect)
        self._thread = threading.Thread(target=self._dispatch, name="hermes-client-events", daemon=True)
        self._thread.start()

    @classmethod
    def connect(
        cls, url: str | None = None, *, home: str | None = None, embedded_ok: bool = True, check_workers: bool = True
    ) -> Gateway:
        """Connect as the command line does: to ``url`` / ``$HERMES_REDIS_URL`` / ``broker.url``; else to the
        embedded broker of the ``serve`` or ``worker`` of the same ``$HERMES_HOME`` running here; else start
        an embedded broker of this gateway's own, with a worker for each queue it calls (both end with it).

        ``check_workers``: a call to a queue no worker listens on raises ``NoWorkers`` at once instead of
        waiting for one (off: it waits, pending, as on a queue whose workers are still starting).
        """
        settings = load_settings(home)
        return cls(find_broker(settings, url, embedded_ok=embedded_ok), settings, check_workers=check_workers)

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the event thread and close the connection (and the embedded broker, if ours)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(redis.RedisError):
            if not self.cluster:
                self.conn.publish(self.channel, b"")  # wake the event thread so it sees the close at once
        self._thread.join(3)
        with contextlib.suppress(redis.RedisError):
            self._pubsub.close()
        if self._own_workers:
            from workers.pool import stop_all

            stop_all(self._own_workers)
        self.broker.close()

    @property
    def description(self) -> str:
        return self.broker.description

    # -- tools -----------------------------------------------------------------------------------

    def register_tool(self, spec: ToolSpec | dict[str, Any]) -> int:
        """Check a spec as registration does and add or update it in the shared directory; returns its version."""
        from workers.specs import check_spec  # (the executors' checks: not loaded by `import hermes_gateway`)

        version, _ = self.directory.register(check_spec(spec))
        return version

    def sync_tools(self, path: Any = None, errors: list[InvalidSpec] | None = None) -> list[tuple[str, int, bool]]:
        """Register every spec file of ``$HERMES_HOME/tools`` (or ``path``).

        A file that does not load is skipped, so one bad file leaves the others usable: it goes to
        ``errors`` when given, else it is logged as a warning.
        """
        return register_dir(self.directory, path or self.settings.tools_dir, errors)

    def tool(self, name: str) -> Entry:
        return self.directory.get(name)

    def tools(self) -> list[Entry]:
        return self.directory.all()

    def policy(self) -> Any:
        """The policy the workers judge by (the one pushed to the broker, else config.yaml's)."""
        from workers import policy_store
        from workers.policy import Policy

        return policy_store.active(self.conn, Policy.from_settings(self.settings.policy))[0]

    def tool_schemas(self, principal: str | None = None) -> list[dict[str, Any]]:
        """OpenAI function tools for every tool ``principal`` may call (the policy workers judge by)."""
        from hermes_gateway.schemas import tool_schemas

        return tool_schemas(self.directory.all(), self.policy(), principal)

    # -- calls -----------------------------------------------------------------------------------

    def _envelope(self, name: str, args: dict[str, Any] | None, opts: dict[str, Any], context: dict[str, Any]) -> tuple[Envelope, ToolSpec]:
        entry = self.directory.get(name)
        return tool_envelope(entry, name, args, opts, context, self.channel_for, self.settings), entry.spec

    def _limits(self, env: Envelope, spec: ToolSpec) -> dict[str, Any]:
        return tool_limits(env, spec, self.settings)

    def call_tool(
        self,
        name: str,
        args: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        queue: str | None = None,
        fairness_key: str | None = None,
        call_class: str | None = None,
        **context: Any,
    ) -> CallHandle:
        """Submit one tool call; raises UnknownTool, QueueFull or IdempotencyConflict at once, else returns its handle.

        ``idempotency_key``: while the call that first used the key is on record (until its result TTL
        after it ends), submitting the same tool and arguments under it returns that call's handle;
        another tool or other arguments are an ``IdempotencyConflict``.

        ``fairness_key`` / ``call_class``: while calls wait for a slot of the tool's limit, slots go round
        robin across fairness keys (default: the call's principal, else its session) and to ``interactive``
        calls (the default) before ``batch`` ones, which keep a minimum share.
        """
        opts: dict[str, Any] = {
            "timeout": timeout,
            "idempotency_key": idempotency_key,
            "max_attempts": max_attempts,
            "traceparent": traceparent,
            "tracestate": tracestate,
            "queue": queue,
            "fairness_key": fairness_key,
            "call_class": call_class,
        }
        with answered(f"submitting a call of {name!r}"), Sending(traceparent, tracestate) as send:
            opts["trace_headers"] = send.headers
            env, spec = self._envelope(name, args, opts, context)
            send.describe(env)
            return self._submit(env, self._limits(env, spec))

    def call_llm(
        self,
        request: dict[str, Any],
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        queue: str = "llm",
        fairness_key: str | None = None,
        call_class: str | None = None,
        **context: Any,
    ) -> CallHandle:
        """Submit one LLM call (chat-completions kwargs): events carry stream deltas, the result the response.

        The provider is ``model:`` of config.yaml as the worker reads it; ``request["model"]`` overrides
        ``model.model`` for this call. Raises QueueFull at once when the model's queue is full, and
        IdempotencyConflict when ``idempotency_key`` belongs to a call with another request.
        """
        check_llm_request(request, context)  # before the producer span starts
        send = Sending(traceparent, tracestate)
        opts = {
            "timeout": timeout,
            "idempotency_key": idempotency_key,
            "max_attempts": max_attempts,
            "queue": queue,
            "fairness_key": fairness_key,
            "call_class": call_class,
        }
        env, limits = llm_envelope(request, self.settings, opts, context, self.channel_for, send.headers)
        with answered("submitting an LLM call"), send:
            send.describe(env)
            return self._submit(env, limits)

    def _submit(self, env: Envelope, limits: dict[str, Any]) -> CallHandle:
        self._ensure_workers((partitions.base(env.queue),))
        handle = self._track(CallHandle(self, env.call_id, env.name, env.kind))
        try:
            pipe = self.conn.pipeline(transaction=False)
            self.calls.submit(env, pipeline=pipe, **limits)
            confirm = durability.queue_wait(pipe, self.settings)  # before the wake-up: workers see it confirmed
            self._wake(pipe, [env.queue])
            # (SUBMIT reads what it discovers before its first write: a refusal of a moving slot means it did
            # not run, so it is sent again while the slot moves)
            replies = pipes.execute(pipe, keep_trying=pipes.for_seconds(pipes.SUBMIT_PATIENCE))
            reply = replies[0]
            self._wake(None, [env.queue])
            if isinstance(reply, Exception):
                raise reply
            accepted, call_id = Calls.check_submit(reply, limits["ckey"], limits["queue_size"], env)
            if confirm and call_id == env.call_id:
                self._confirm(replies[1], env)
        except BaseException:
            self._untrack(env.call_id)
            raise
        if call_id != env.call_id:  # idempotent resubmission: follow the call that already exists
            self._untrack(env.call_id)
            handle = self._existing(reply, call_id, env)
        return handle

    def _confirm(self, acked: Any, env: Envelope) -> None:
        """Raise BrokerNotDurable, the call cancelled, when WAIT confirmed it on too few replicas."""
        error = durability.shortfall(acked, self.settings, f"call {env.call_id} ({env.name}) not accepted", call_id=env.call_id)
        if error is None:
            return
        try:
            error.details["cancelled"] = cancel_call(self, env.call_id)
        except redis.RedisError as e:  # the broker failed meanwhile: the caller is told it may still run
            error.details["cancelled"] = False
            error.message += f"; cancelling it failed too ({e}): gw.handle({env.call_id!r}) finds it if it was kept"
        raise error

    def _existing(self, reply: Any, call_id: str, env: Envelope) -> CallHandle:
        """A handle on the call an idempotent resubmission found, named as that call is."""
        name, kind = Calls.existing_call(reply) or (env.name, env.kind)
        return CallHandle(self, call_id, name, kind, own=False)

    def map(self, name: str, items: Iterable[dict[str, Any]], **common: Any) -> Batch:
        """Submit many calls of one tool, pipelined; refused items raise on ``result()``."""
        return self.submit_many(((name, args) for args in items), **common)

    def submit_many(self, calls: Iterable[tuple[str, dict[str, Any]]], **common: Any) -> Batch:
        """Submit (tool, args) pairs; each gets a handle, refused ones carry their error.

        ``idempotency_keys``: one key (or None) per item, as ``call_tool``'s ``idempotency_key``; an item
        whose key belongs to another call's request is refused with ``IdempotencyConflict``, one whose
        key names the same request gets that call's handle.

        Every item is built and validated first (an unknown tool or bad argument raises before anything
        is sent); then the calls go out in pipelines of ``SUBMIT_CHUNK``, each waking the workers, so
        workers start on the first calls while the rest are still being sent. A broker failure on the
        first pipeline raises; on a later one, the items of that pipeline are refused as "outcome unknown"
        (the server may have taken some) and the rest as not sent, without waiting on the broker again.
        """
        with answered("submitting a batch of calls"):
            return self._submit_many(calls, **common)

    def _submit_many(self, calls: Iterable[tuple[str, dict[str, Any]]], **common: Any) -> Batch:
        """``submit_many`` without its BrokerUnavailable translation."""
        names = ("timeout", "max_attempts", "traceparent", "tracestate", "queue", "fairness_key", "call_class")
        opts: dict[str, Any] = {k: common.pop(k) for k in names if k in common}
        idempotency_keys: Sequence[str | None] | None = common.pop("idempotency_keys", None)
        check_batch_keys(common, idempotency_keys)
        send = Sending(opts.get("traceparent"), opts.get("tracestate"))  # one producer span for the batch
        opts["trace_headers"] = send.headers
        prepared = []
        try:
            for i, (name, args) in enumerate(calls):
                env, spec = self._envelope(name, args, item_opts(opts, idempotency_keys, i), common)
                prepared.append((env, self._limits(env, spec), self._track(CallHandle(self, env.call_id, name))))
            check_batch_keys(common, idempotency_keys, len(prepared))
            self._ensure_workers(tuple(dict.fromkeys(partitions.base(env.queue) for env, _, _ in prepared)))
        except BaseException:
            for env, _, _ in prepared:
                self._untrack(env.call_id)
            raise
        handles = Batch()
        done = 0  # items settled (accepted or refused); the rest are untracked if anything escapes
        try:
            with send:
                send.describe(prepared[0][0] if prepared else None, len(prepared))
                failure: redis.RedisError | None = None
                for start in range(0, len(prepared), SUBMIT_CHUNK):
                    chunk = prepared[start : start + SUBMIT_CHUNK]
                    replies: list[Any]
                    acked: Any = None  # WAIT's reply for this pipeline, when confirmations are asked for
                    if failure is not None:  # the broker failed on an earlier pipeline: do not wait on it again
                        replies = [HermesError(f"not sent: the broker failed earlier in this batch: {failure}")]
                        replies *= len(chunk)
                    else:
                        try:
                            replies, acked = self._send_chunk(chunk)
                        except redis.RedisError as e:
                            if start == 0:
                                raise
                            failure = e
                            # The server may have taken some of this pipeline before the connection broke.
                            unknown = HermesError(
                                f"submission outcome unknown: {e}; gw.handle(call_id) finds the call if it was taken"
                            )
                            replies = [unknown] * len(chunk)
                    for (env, limits, handle), reply in zip(chunk, replies, strict=True):
                        try:
                            if isinstance(reply, Exception):
                                raise reply if isinstance(reply, HermesError) else broker_error("submission failed", reply)
                            _, call_id = Calls.check_submit(reply, limits["ckey"], limits["queue_size"], env)
                            if call_id != env.call_id:  # idempotent: follow the call that already exists
                                self._untrack(env.call_id)
                                handle = self._existing(reply, call_id, env)
                            elif acked is not None:
                                self._confirm(acked, env)
                        except (QueueFull, HermesError) as e:
                            self._untrack(env.call_id)
                            handle._refuse(e)
                        handles.append(handle)
                        done += 1
        except BaseException:
            for env, _, _ in prepared[done:]:
                self._untrack(env.call_id)
            raise
        return handles

    def _send_chunk(self, chunk: list[tuple[Envelope, dict[str, Any], CallHandle]]) -> tuple[list[Any], Any]:
        """The SUBMIT replies of ``chunk``, and WAIT's reply (None when not asked for)."""
        pipe = self.conn.pipeline(transaction=False)
        for env, limits, _ in chunk:
            self.calls.submit(env, pipeline=pipe, **limits)
        confirm = durability.queue_wait(pipe, self.settings)
        queues = list(dict.fromkeys(partitions.base(env.queue) for env, _, _ in chunk))
        self._wake(pipe, queues)
        replies = pipes.execute(pipe, keep_trying=pipes.for_seconds(pipes.SUBMIT_PATIENCE))
        self._wake(None, queues)
        return replies[: len(chunk)], replies[len(chunk)] if confirm else None

    def _wake(self, pipe: Any, queues: list[str]) -> None:
        """Wake the workers of ``queues``: in the submission's pipeline on a plain Redis (``pipe``), after
        it on a cluster (``pipe`` None; a cluster pipeline carries no PUBLISH)."""
        if (pipe is None) != self.cluster:
            return
        for queue in queues:
            (pipe if pipe is not None else self.conn).publish(self.calls.wake_channel(queue), b"")

    def cancel(self, call_id: str) -> bool:
        return cancel_call(self, call_id)

    # -- batches ---------------------------------------------------------------------------------

    def batch(
        self,
        tool: str,
        items: Iterable[dict[str, Any]],
        *,
        window: int | None = None,
        ttl: int | None = None,
        resume: str | None = None,
        **context: Any,
    ) -> BatchJob:
        """Run ``tool`` over ``items`` (argument mappings) as a batch: returns at once with its id while a
        thread sends the items, at most ``window`` calls unfinished (``batch.window``); its counters and
        results live in Redis for ``ttl`` (``batch.ttl``). ``resume``: the id of a batch whose submitter
        died; the same items are sent again and only those with no result yet run."""
        from hermes_gateway.batches import start

        with answered(f"starting a batch of {tool!r}"):
            return start(self, tool, items, window=window, ttl=ttl, resume=resume, context=context)

    def batch_job(self, batch_id: str) -> BatchJob:
        """A batch made by any process, by id (raises UnknownBatch when none is on record)."""
        from hermes_gateway.batches import BatchJob, BatchStore

        BatchStore(self.conn).meta(batch_id)
        return BatchJob(self, batch_id)

    def handle(self, call_id: str) -> CallHandle:
        """A handle on any call by id (for example one submitted by another process)."""
        rec = self.calls.record(call_id)
        if rec is None:
            from broker.errors import CallFailed

            raise CallFailed(f"no such call {call_id}", error_type="unknown_call")
        h = CallHandle(self, call_id, rec["name"], rec["kind"], own=rec["channel"] in self._channels)
        h.sync()
        return h
