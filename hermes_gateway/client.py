"""The Gateway client: submit tool and LLM calls, follow their events, get typed results."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import redis
import structlog

from broker import events as ev_mod
from broker import keys, pipes
from broker.calls import Calls
from broker.codec import text
from broker.config import Settings, load_settings
from broker.connection import BrokerHandle, answered, connect, subscriber
from broker.directory import Directory, Entry, sync_dir
from broker.envelope import Envelope
from broker.errors import HermesError, InvalidSpec, NoWorkers, QueueFull
from broker.toolspec import ToolSpec
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

log = structlog.get_logger("hermes.client")

SUBMIT_CHUNK = 100  # calls per pipelined round trip in submit_many


def current_traceparent() -> tuple[str | None, str | None]:
    """The traceparent/tracestate of the caller's current OpenTelemetry span, if any."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return None, None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent"), carrier.get("tracestate")


# How long the event thread reads the subscription directly with nothing arriving before it goes back to
# redis-py's reader (which keeps the connection's health checks).
DIRECT_READ_IDLE = 1.0


class Gateway:
    """A client of the gateway: one connection, one event channel, many calls in flight."""

    def __init__(self, handle: BrokerHandle, settings: Settings | None = None) -> None:
        self.broker = handle
        self.conn: redis.Redis = handle.conn
        self.settings = settings or load_settings()
        self.client_id = uuid.uuid4().hex
        self.channel = keys.caller_channel(self.client_id)
        self.calls = Calls(self.conn)
        self.directory = Directory(self.conn)
        self._handles: dict[str, CallHandle] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._pubsub = subscriber(self.conn)
        self._tools_channel = keys.channel(self.conn, keys.TOOLS_CHANNEL).encode()
        self._pubsub.subscribe(self.channel, self._tools_channel)
        self._thread = threading.Thread(target=self._dispatch, name="hermes-client-events", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, url: str | None = None, *, home: str | None = None, embedded_ok: bool = True) -> Gateway:
        """Connect to ``url`` / ``$HERMES_REDIS_URL``, else start the embedded broker."""
        settings = load_settings(home)
        return cls(connect(url or settings.redis_url, embedded_ok=embedded_ok), settings)

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the event thread and close the connection (and the embedded broker, if ours)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.conn.publish(self.channel, b"")  # wake the event thread so it sees the close at once
        except redis.RedisError:
            pass
        self._thread.join(3)
        try:
            self._pubsub.close()
        except redis.RedisError:
            pass
        self.broker.close()

    @property
    def description(self) -> str:
        return self.broker.description

    # -- tools -----------------------------------------------------------------------------------

    def register_tool(self, spec: ToolSpec | dict[str, Any]) -> int:
        """Add or update a tool in the shared directory; returns its version."""
        version, _ = self.directory.register(spec)
        return version

    def sync_tools(self, path: Any = None, errors: list[InvalidSpec] | None = None) -> list[tuple[str, int, bool]]:
        """Register every spec file of ``$HERMES_HOME/tools`` (or ``path``).

        A file that does not load is skipped, so one bad file leaves the others usable: it goes to
        ``errors`` when given, else it is logged as a warning.
        """
        from pathlib import Path

        bad: list[InvalidSpec] = [] if errors is None else errors
        done = sync_dir(self.directory, Path(path) if path else self.settings.tools_dir, bad)
        if errors is None:
            for e in bad:
                log.warning("tool spec skipped", error=str(e))
        return done

    def tool(self, name: str) -> Entry:
        return self.directory.get(name)

    def tools(self) -> list[Entry]:
        return self.directory.all()

    def tool_schemas(self, principal: str | None = None) -> list[dict[str, Any]]:
        """OpenAI function tools for every tool ``principal`` may call (the policy workers judge by)."""
        from hermes_gateway.schemas import tool_schemas
        from workers import policy_store
        from workers.policy import Policy

        policy, _ = policy_store.active(self.conn, Policy.from_settings(self.settings.policy))
        return tool_schemas(self.directory.all(), policy, principal)

    # -- calls -----------------------------------------------------------------------------------

    def _envelope(self, name: str, args: dict[str, Any] | None, opts: dict[str, Any], context: dict[str, Any]) -> tuple[Envelope, ToolSpec]:
        entry = self.directory.get(name)
        env = tool_envelope(entry, name, args, opts, context, self.channel, self.settings.max_args)
        return env, entry.spec

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
        **context: Any,
    ) -> CallHandle:
        """Submit one tool call; raises UnknownTool, QueueFull or IdempotencyConflict at once, else returns its handle.

        ``idempotency_key``: while the call that first used the key is on record (until its result TTL
        after it ends), submitting the same tool and arguments under it returns that call's handle;
        another tool or other arguments are an ``IdempotencyConflict``.
        """
        opts: dict[str, Any] = {
            "timeout": timeout,
            "idempotency_key": idempotency_key,
            "max_attempts": max_attempts,
            "traceparent": traceparent,
            "tracestate": tracestate,
            "queue": queue,
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
        **context: Any,
    ) -> CallHandle:
        """Submit one LLM call (chat-completions kwargs): events carry stream deltas, the result the response.

        The provider is ``model:`` of config.yaml as the worker reads it; ``request["model"]`` overrides
        ``model.model`` for this call. Raises QueueFull at once when the model's queue is full, and
        IdempotencyConflict when ``idempotency_key`` belongs to a call with another request.
        """
        check_llm_request(request, context)  # before the producer span starts
        send = Sending(traceparent, tracestate)
        opts = {"timeout": timeout, "idempotency_key": idempotency_key, "max_attempts": max_attempts, "queue": queue}
        env, limits = llm_envelope(request, self.settings, opts, context, self.channel, send.headers)
        with answered("submitting an LLM call"), send:
            send.describe(env)
            return self._submit(env, limits)

    def _submit(self, env: Envelope, limits: dict[str, Any]) -> CallHandle:
        handle = self._track(CallHandle(self, env.call_id, env.name, env.kind))
        try:
            pipe = self.conn.pipeline(transaction=False)
            self.calls.submit(env, pipeline=pipe, **limits)
            pipe.publish(keys.channel(self.conn, keys.wake(env.queue)), b"")
            reply = pipes.execute(pipe)[0]
            if isinstance(reply, Exception):
                raise reply
            accepted, call_id = Calls.check_submit(reply, limits["ckey"], limits["queue_size"], env)
        except BaseException:
            self._untrack(env.call_id)
            raise
        if call_id != env.call_id:  # idempotent resubmission: follow the call that already exists
            self._untrack(env.call_id)
            handle = self._existing(reply, call_id, env)
        return handle

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
        names = ("timeout", "max_attempts", "traceparent", "tracestate", "queue")
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
                    if failure is not None:  # the broker failed on an earlier pipeline: do not wait on it again
                        replies = [HermesError(f"not sent: the broker failed earlier in this batch: {failure}")]
                        replies *= len(chunk)
                    else:
                        try:
                            replies = self._send_chunk(chunk)
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
                                raise reply if isinstance(reply, HermesError) else HermesError(f"submission failed: {reply}")
                            _, call_id = Calls.check_submit(reply, limits["ckey"], limits["queue_size"], env)
                            if call_id != env.call_id:  # idempotent: follow the call that already exists
                                self._untrack(env.call_id)
                                handle = self._existing(reply, call_id, env)
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

    def _send_chunk(self, chunk: list[tuple[Envelope, dict[str, Any], CallHandle]]) -> list[Any]:
        pipe = self.conn.pipeline(transaction=False)
        for env, limits, _ in chunk:
            self.calls.submit(env, pipeline=pipe, **limits)
        for queue in dict.fromkeys(env.queue for env, _, _ in chunk):
            pipe.publish(keys.channel(self.conn, keys.wake(queue)), b"")
        return pipes.execute(pipe)[: len(chunk)]

    def cancel(self, call_id: str) -> bool:
        return cancel_call(self, call_id)

    def handle(self, call_id: str) -> CallHandle:
        """A handle on any call by id (for example one submitted by another process)."""
        rec = self.calls.record(call_id)
        if rec is None:
            from broker.errors import CallFailed

            raise CallFailed(f"no such call {call_id}", error_type="unknown_call")
        h = CallHandle(self, call_id, rec["name"], rec["kind"], own=rec["channel"] == self.channel)
        h.sync()
        return h

    # -- cluster ---------------------------------------------------------------------------------

    def live_workers(self, queue: str | None = None, within: float | None = None) -> list[dict[str, Any]]:
        """Workers whose heartbeat is recent, optionally only those listening on ``queue``."""
        horizon = time.time() - (within or max(15.0, self.settings.lease))
        names = self.conn.zrangebyscore(keys.WORKERS, horizon, "+inf")
        pipe = self.conn.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.worker(text(n)))
        out = []
        for raw in pipe.execute():
            if not raw:
                continue
            w = {k.decode(): v.decode() for k, v in raw.items()}
            if queue is None or queue in w.get("queues", "").split(","):
                out.append(w)
        return out

    def require_workers(self, queue: str) -> None:
        if not self.live_workers(queue):
            raise NoWorkers(
                f"no worker listens on queue {queue!r} at {self.description}; start one with "
                f"`hermes-gateway worker --queues {queue}`",
                queue=queue,
            )

    # -- events ----------------------------------------------------------------------------------

    def _track(self, handle: CallHandle) -> CallHandle:
        with self._lock:
            self._handles[handle.call_id] = handle
        return handle

    def _untrack(self, call_id: str, handle: CallHandle | None = None) -> None:
        """Stop feeding ``call_id`` (only if it is still ``handle``, when one is given)."""
        with self._lock:
            if handle is None or self._handles.get(call_id) is handle:
                self._handles.pop(call_id, None)

    def _dispatch(self) -> None:
        while not self._closed.is_set():
            try:
                # redis-py's reader reconnects, subscribes again and sends health checks ...
                msg = self._pubsub.get_message(timeout=0.5)
                if msg is not None and not self._closed.is_set():
                    self._on_message(msg["channel"], msg["data"])
                # ... and while the subscription is up and busy, messages are read straight off it.
                self._read_direct()
            except (redis.ConnectionError, redis.TimeoutError, ValueError):
                if self._closed.is_set():
                    return
                time.sleep(0.5)

    def _read_direct(self) -> None:
        """Read published messages off the subscribed connection until it has been idle for a while.

        Per message this skips the layers of ``PubSub.get_message`` (retry wrapper, health-check
        bookkeeping, message dicts), which under load cost more than handling the event. A health-check
        answer read here is counted as ``get_message`` would; any trouble goes back to ``get_message``.
        """
        pubsub, conn = self._pubsub, self._pubsub.connection
        if conn is None or not pubsub.subscribed:
            return
        while not self._closed.is_set():
            try:
                # (RESP3 delivers messages as pushes: push_request hands them back instead of skipping them)
                reply = conn.read_response(timeout=DIRECT_READ_IDLE, disconnect_on_error=False, push_request=True)
            except redis.TimeoutError:
                return  # idle: get_message takes over (and sends its health check when due)
            except (redis.ConnectionError, OSError):
                conn.disconnect()  # get_message reconnects and subscribes again
                return
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                self._on_message(reply[1], reply[2])
            elif pubsub.is_health_check_response(reply) and pubsub.health_check_response_counter > 0:
                pubsub.health_check_response_counter -= 1

    def _on_message(self, channel: bytes, data: bytes) -> None:
        try:
            self._route(channel, data)
        except Exception as e:  # noqa: BLE001 - one bad message must not stop the event thread
            log.warning("event message skipped", channel=channel, error=f"{type(e).__name__}: {e}")

    def _route(self, channel: bytes, data: bytes) -> None:
        if channel == self._tools_channel:
            self.directory.invalidate(data.decode(errors="replace"))
            return
        if not data or self._closed.is_set():
            return  # the wake-up close() publishes
        routed = ev_mod.for_handle(self._handles, data)
        if routed is not None:
            event, handle, gap = routed
            if gap:
                handle.sync()  # fill it from the durable history
            handle._feed(event)  # the terminal event untracks the handle
