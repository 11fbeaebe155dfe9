"""The Gateway client: submit tool and LLM calls, follow their events, get typed results (a face over
``hermes_gateway.clientcore``, with one thread that hears events)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis
import structlog

from broker import durability, keys, pipes
from broker import events as ev_mod
from broker.calls import Calls
from broker.codec import pack, text
from broker.config import Settings, load_settings
from broker.connection import BrokerHandle, answered, broker_error, is_cluster, subscriber
from broker.directory import Directory, Entry
from broker.envelope import Envelope
from broker.errors import BrokerUnavailable, CallFailed, HermesError, InvalidSpec, QueueFull
from broker.states import TERMINAL, State
from broker.toolspec import ToolSpec
from hermes_gateway.clientcore import (
    CANCEL_FIELDS,
    PENDING_CANCEL,
    RETRYING_CANCEL,
    CallOptions,
    CancelTarget,
    Router,
    WorkerCheck,
    check_batch_keys,
    check_llm_request,
    find_broker,
    llm_envelope,
    register_dir,
    tool_envelope,
    tool_limits,
)
from hermes_gateway.handle import Batch, CallHandle
from hermes_gateway.tracing import Sending

if TYPE_CHECKING:
    from hermes_gateway.batches import BatchJob

log = structlog.get_logger("hermes.client")

SUBMIT_CHUNK = 100  # calls per pipelined round trip in submit_many
DIRECT_READ_IDLE = 1.0  # seconds of quiet before the event thread goes back to redis-py's reader
CLUSTER_POLL = 0.05  # seconds a cluster client's event thread waits on its sharded channels per round
SUBSCRIBE_WAIT = 5.0  # seconds to wait for the server to confirm a new sharded subscription
CATCH_UP_CHUNK = 500  # history reads per pipelined round trip when the subscription comes back


def _function_tool(spec: ToolSpec) -> dict[str, Any]:
    """One tool in the chat-completions ``tools`` shape."""
    parameters = dict(spec.input_schema)
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})  # (some providers refuse an object schema without it)
    return {
        "type": "function",
        "function": {"name": spec.name, "description": spec.description, "parameters": parameters},
    }


class Gateway:
    """A client of the gateway: one connection, one event channel, many calls in flight."""

    def __init__(
        self, handle: BrokerHandle, settings: Settings | None = None, *, check_workers: bool = False
    ) -> None:
        self.broker = handle
        self.conn: redis.Redis = handle.conn
        self.settings = settings or load_settings()
        self.workers = WorkerCheck(handle, self.settings, check_workers)
        durability.check_supported(self.conn, self.settings)
        self.client_id = uuid.uuid4().hex
        self.channel = keys.caller_channel(self.client_id)
        pipes.configure(self.settings.broker.fast_path)
        self.calls = Calls(self.conn)
        self.calls.keep_history = self.settings.workers.keep_history
        self.directory = Directory(self.conn)
        self.router: Router[CallHandle] = Router()
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
        """Connect as the command line does (``find_broker``); on an embedded broker of its own, a worker is
        started for each queue it calls. ``check_workers``: a call to a queue no worker listens on raises
        ``NoWorkers`` at once instead of waiting, pending."""
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
        self.workers.close()
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
        """Register every spec file of ``$HERMES_HOME/tools`` (or ``path``); see ``register_dir``."""
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
        """OpenAI function tools, by name, for every tool ``principal`` may call (as the policy says)."""
        specs = sorted((e.spec for e in self.directory.all()), key=lambda s: s.name)
        return [_function_tool(s) for s in self.policy().allowed_tools(principal, specs)]

    # -- calls -----------------------------------------------------------------------------------

    def _prepare(self, name: str, args: dict[str, Any] | None, opts: CallOptions, context: dict[str, Any]) -> tuple[Envelope, dict[str, Any]]:
        """The envelope of a call of tool ``name`` and its admission limits."""
        entry = self.directory.get(name)
        env = tool_envelope(entry, name, args, opts, context, self.channel_for, self.settings)
        return env, tool_limits(env, entry.spec, self.settings)

    def call_tool(
        self, name: str, args: dict[str, Any] | None = None, *, timeout: float | None = None,
        idempotency_key: str | None = None, max_attempts: int | None = None, traceparent: str | None = None,
        tracestate: str | None = None, queue: str | None = None, fairness_key: str | None = None,
        call_class: str | None = None, **context: Any,
    ) -> CallHandle:
        """Submit one tool call; raises UnknownTool, QueueFull or IdempotencyConflict at once, else returns its handle.

        ``timeout``: seconds the call may run at its worker, in place of its spec's ``timeout`` (longer or
        shorter); how long to wait for it is ``result(timeout=)``'s.

        ``idempotency_key``: while the key's call is on record, the same tool and arguments under it get
        that call's handle; others are an ``IdempotencyConflict``. ``fairness_key`` / ``call_class``: waiting
        calls get slots round robin across keys (default: principal, else session), ``interactive`` first.
        """
        with answered(f"submitting a call of {name!r}"), Sending(traceparent, tracestate) as send:
            opts = CallOptions(timeout, idempotency_key, max_attempts, traceparent, tracestate, queue,
                               fairness_key, call_class, trace_headers=send.headers)
            env, limits = self._prepare(name, args, opts, context)
            send.describe(env)
            return self._submit(env, limits)

    def call_llm(
        self, request: dict[str, Any], *, timeout: float | None = None, idempotency_key: str | None = None,
        max_attempts: int | None = None, traceparent: str | None = None, tracestate: str | None = None,
        queue: str = "llm", fairness_key: str | None = None, call_class: str | None = None, **context: Any,
    ) -> CallHandle:
        """Submit one LLM call (chat-completions kwargs) to config.yaml's ``model:`` (``request["model"]``
        overrides ``model.model``): events carry stream deltas, the result is the response."""
        check_llm_request(request, context)  # before the producer span starts
        send = Sending(traceparent, tracestate)
        opts = CallOptions(timeout, idempotency_key, max_attempts, traceparent, tracestate, queue,
                           fairness_key, call_class, trace_headers=send.headers)
        env, limits = llm_envelope(request, self.settings, opts, context, self.channel_for)
        with answered("submitting an LLM call"), send:
            send.describe(env)
            return self._submit(env, limits)

    def _submit(self, env: Envelope, limits: dict[str, Any]) -> CallHandle:
        self.workers.ensure((env.queue,))
        handle = self.router.track(CallHandle(self, env.call_id, env.name, env.kind))
        try:
            (reply,), acked = self._send_chunk([(env, limits, handle)])
            if isinstance(reply, Exception):
                raise reply
            return self._settle(env, limits, handle, reply, acked)
        except BaseException:
            self.router.drop(env.call_id)
            raise

    def _settle(self, env: Envelope, limits: dict[str, Any], handle: CallHandle, reply: Any, acked: Any) -> CallHandle:
        """The handle of a submitted call from SUBMIT's reply (and WAIT's, ``acked``, when confirmations
        are asked for): that of the existing call for an idempotent resubmission; raises its refusal."""
        _, call_id = Calls.check_submit(reply, limits["ckey"], limits["queue_size"], env)
        if call_id != env.call_id:  # idempotent resubmission: follow the call that already exists
            self.router.drop(env.call_id)
            name, kind = Calls.existing_call(reply) or (env.name, env.kind)
            return CallHandle(self, call_id, name, kind, own=False)
        if acked is not None:
            self._confirm(acked, env)
        return handle

    def _confirm(self, acked: Any, env: Envelope) -> None:
        """Raise BrokerNotDurable, the call cancelled, when WAIT confirmed it on too few replicas."""
        error = durability.shortfall(acked, self.settings, f"call {env.call_id} ({env.name}) not accepted", call_id=env.call_id)
        if error is None:
            return
        try:
            error.details["cancelled"] = self.cancel(env.call_id)
        except redis.RedisError as e:  # the broker failed meanwhile: the caller is told it may still run
            error.details["cancelled"] = False
            error.message += f"; cancelling it failed too ({e}): gw.handle({env.call_id!r}) finds it if it was kept"
        raise error

    def map(self, name: str, items: Iterable[dict[str, Any]], **common: Any) -> Batch:
        """Submit many calls of one tool, pipelined; refused items raise on ``result()``."""
        return self.submit_many(((name, args) for args in items), **common)

    def submit_many(self, calls: Iterable[tuple[str, dict[str, Any]]], **common: Any) -> Batch:
        """Submit (tool, args) pairs; each gets a handle, refused ones carry their error.

        ``idempotency_keys``: one key (or None) per item, as ``call_tool``'s. Every item is validated before
        anything is sent, then they go in pipelines of ``SUBMIT_CHUNK``. A broker failure on the first
        pipeline raises; on a later one, its items are refused as "outcome unknown", the rest as not sent.
        """
        with answered("submitting a batch of calls"):
            return self._submit_many(calls, **common)

    def _submit_many(self, calls: Iterable[tuple[str, dict[str, Any]]], **common: Any) -> Batch:
        opts = CallOptions.take(common)
        idempotency_keys: Sequence[str | None] | None = common.pop("idempotency_keys", None)
        check_batch_keys(common, idempotency_keys)
        send = Sending(opts.traceparent, opts.tracestate)  # one producer span for the batch
        opts = dataclasses.replace(opts, trace_headers=send.headers)
        prepared: list[tuple[Envelope, dict[str, Any], CallHandle]] = []
        handles = Batch()
        done = 0  # items settled (accepted or refused); the rest are untracked if anything escapes
        try:
            for i, (name, args) in enumerate(calls):
                env, limits = self._prepare(name, args, opts.item(idempotency_keys, i), common)
                prepared.append((env, limits, self.router.track(CallHandle(self, env.call_id, name))))
            check_batch_keys(common, idempotency_keys, len(prepared))
            self.workers.ensure(env.queue for env, _, _ in prepared)
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
                            handle = self._settle(env, limits, handle, reply, acked)
                        except (QueueFull, HermesError) as e:
                            self.router.drop(env.call_id)
                            handle.refuse(e)
                        handles.append(handle)
                        done += 1
        except BaseException:
            for env, _, _ in prepared[done:]:
                self.router.drop(env.call_id)
            raise
        return handles

    def _send_chunk(self, chunk: list[tuple[Envelope, dict[str, Any], CallHandle]]) -> tuple[list[Any], Any]:
        """The SUBMIT replies of ``chunk``, and WAIT's reply (None when not asked for)."""
        pipe = self.conn.pipeline(transaction=False)
        for env, limits, _ in chunk:
            self.calls.submit(env, pipeline=pipe, **limits)
        confirm = durability.queue_wait(pipe, self.settings)  # before the wake-up: workers see it confirmed
        queues = list(dict.fromkeys(keys.base_queue(env.queue) for env, _, _ in chunk))
        self.wake(pipe, queues)
        # (a SUBMIT refused for a moving slot did not run: it is sent again while the slot moves)
        replies = pipes.execute(pipe, keep_trying=pipes.for_seconds(pipes.SUBMIT_PATIENCE))
        self.wake(None, queues)
        return replies[: len(chunk)], replies[len(chunk)] if confirm else None

    def wake(self, pipe: Any, queues: list[str]) -> None:
        """Wake the workers of ``queues``: in the submission's pipeline on a plain Redis (``pipe``), after
        it on a cluster (``pipe`` None; a cluster pipeline carries no PUBLISH)."""
        if (pipe is None) != self.cluster:
            return
        for queue in queues:
            (pipe if pipe is not None else self.conn).publish(self.calls.wake_channel(queue), b"")

    def cancel(self, call_id: str) -> bool:
        """Cancel by id; True when the request was recorded (the call was not already finished). A call no
        worker has taken ends here (with its audit record); a leased one's worker is told to stop it."""
        conn = self.conn
        target = CancelTarget.of(call_id, conn.hmget(keys.job(call_id), *CANCEL_FIELDS))
        if target is None or target.state in TERMINAL:
            return False
        info = target.info
        retrying = target.state == State.RETRYING  # (between attempts: no worker holds it either)
        if retrying or (target.state == State.PENDING and conn.zscore(keys.leases(keys.tag(info.queue)), call_id) is None):
            error = RETRYING_CANCEL if retrying else PENDING_CANCEL
            reply = self.calls.cancel_unleased(info, attempt=target.attempt, error=error, retrying=retrying)
            if int(reply[0]) > 0:
                from broker.audit import AuditLog

                sensitive: tuple[str, ...] = ()
                if info.kind == "tool":
                    with contextlib.suppress(HermesError):  # removed meanwhile: still redacted by name
                        sensitive = self.directory.get(info.name).spec.sensitive
                AuditLog.from_settings(conn, self.settings.audit).append(target.audit_record(sensitive, error))
                return True
        conn.hset(keys.job(call_id), keys.F_CANCEL, "1")
        conn.publish(keys.channel(conn, keys.CONTROL_CHANNEL), pack({"op": "cancel", "call_id": call_id}))
        return True

    # -- workers ---------------------------------------------------------------------------------

    def live_workers(self, queue: str | None = None, within: float | None = None) -> list[dict[str, Any]]:
        """Workers whose heartbeat is recent, optionally only those listening on ``queue``."""
        return self.workers.live_workers(queue, within)

    def require_workers(self, queue: str) -> None:
        """NoWorkers unless a live worker listens on ``queue``."""
        self.workers.require_workers(queue)

    # -- batches ---------------------------------------------------------------------------------

    def batch(
        self, tool: str, items: Iterable[dict[str, Any]], *, window: int | None = None,
        ttl: int | None = None, resume: str | None = None, **context: Any,
    ) -> BatchJob:
        """Run ``tool`` over ``items`` (argument mappings) as a batch sent by a thread, at most ``window``
        calls unfinished, kept ``ttl`` seconds (``batch.*`` by default). ``resume``: the id of a batch whose
        submitter died; only its items with no result yet run."""
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
        name, kind, channel = (text(v) if v is not None else None for v in self.conn.hmget(keys.job(call_id), keys.F_TOOL, keys.F_KIND, keys.F_CHANNEL))
        if kind is None:
            raise CallFailed(f"no such call {call_id}", error_type="unknown_call")
        h = CallHandle(self, call_id, name or "", kind, own=channel in self._channels)
        h.sync()
        return h

    # -- events ----------------------------------------------------------------------------------

    def channel_for(self, queue: str) -> str:
        """The channel of this client's calls on ``queue``: its one channel; on a cluster, its sharded
        channel of the queue's tag, subscribed and confirmed before the first call there is sent."""
        if not self.cluster:
            return self.channel
        ch = keys.caller_channel(self.client_id, keys.tag(queue))
        if ch in self._channels:
            return ch
        confirmed = self._confirmed.setdefault(ch, threading.Event())
        with self._sub_lock:
            self._pubsub.ssubscribe(ch)
        self._channels.add(ch)
        if not confirmed.wait(SUBSCRIBE_WAIT):
            raise BrokerUnavailable(f"the broker did not confirm the subscription to {ch} in time")
        return ch

    def _dispatch(self) -> None:
        if self.cluster:
            self._dispatch_cluster()
            return
        while not self._closed.is_set():
            try:
                # redis-py's reader reconnects, subscribes again and sends health checks ...
                msg = self._pubsub.get_message(timeout=0.5)
                if self._catch_up_due:  # (the subscription is back: what was published meanwhile is lost)
                    self._catch_up_due = False
                    self.catch_up()
                if msg is not None and not self._closed.is_set():
                    self._on_message(msg["channel"], msg["data"])
                # ... and while the subscription is up and busy, messages are read straight off it.
                self._read_direct()
            except (redis.ConnectionError, redis.TimeoutError, ValueError):
                if self._closed.is_set():
                    return
                time.sleep(0.2)

    def _on_reconnect(self, connection: Any) -> None:
        """redis-py's connect callback of the subscription (after its own, which subscribes again)."""
        self._catch_up_due = True

    def catch_up(self) -> None:
        """Read the durable history of every call still waited on, in pipelined round trips (when the
        subscription comes back: what was published meanwhile is lost). Raises the broker's error."""
        pending = self.router.waiting()
        for start in range(0, len(pending), CATCH_UP_CHUNK):
            chunk = pending[start : start + CATCH_UP_CHUNK]
            pipe = self.conn.pipeline(transaction=False)
            self.router.read_history(pipe, chunk)
            try:
                stored = pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError):
                self._catch_up_due = True
                raise
            self.router.feed_history(chunk, stored)

    def _dispatch_cluster(self) -> None:
        """A cluster's loop: the directory's notices and the sharded channels of the queue tags, in turn."""
        pubsub = self._pubsub
        while not self._closed.is_set():
            try:
                with self._sub_lock:
                    msgs = [pubsub.get_message(timeout=0.0)]
                    if pubsub.shard_channels:
                        msgs.append(pubsub.get_sharded_message(timeout=CLUSTER_POLL))
                for msg in msgs:
                    if msg is None or self._closed.is_set():
                        continue
                    if msg["type"] in ("message", "smessage"):
                        self._on_message(msg["channel"], msg["data"])
                    elif msg["type"] == "ssubscribe":
                        self._confirmed.setdefault(text(msg["channel"]), threading.Event()).set()
                if not pubsub.shard_channels:
                    self._closed.wait(CLUSTER_POLL)
            except (redis.ConnectionError, redis.TimeoutError, ValueError):
                if self._closed.is_set():
                    return
                time.sleep(0.5)

    def _read_direct(self) -> None:
        """Read messages straight off the subscribed connection, skipping ``PubSub.get_message``'s layers,
        until it is idle (a health-check answer is counted as there); any trouble goes back to it."""
        pubsub, conn = self._pubsub, self._pubsub.connection
        if not pipes.FAST or conn is None or not pubsub.subscribed:
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
            if channel == self._tools_channel:
                self.directory.invalidate(data.decode(errors="replace"))
                return
            if not data or self._closed.is_set():
                return  # the wake-up close() publishes
            routed = ev_mod.for_handle(self.router.handles, data)  # (event, handle, missed some)
            if routed is not None:
                event, handle, gap = routed
                if gap:
                    handle.sync()  # fill it from the durable history
                handle.feed(event)  # the terminal event untracks the handle
        except Exception as e:  # noqa: BLE001 - one bad message must not stop the event thread
            log.warning("event message skipped", channel=channel, error=f"{type(e).__name__}: {e}")
