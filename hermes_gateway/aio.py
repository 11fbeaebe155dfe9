"""The asyncio client: the ``Gateway`` surface on ``redis.asyncio``, with no threads; a face over
``hermes_gateway.clientcore`` as ``Gateway`` is. One pub/sub task feeds every handle."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
import structlog
from redis import RedisError

from broker import durability, keys, scripts
from broker import events as ev_mod
from broker.calls import Calls
from broker.codec import pack, text, unpack
from broker.config import Settings, load_settings
from broker.connection import (
    BrokerHandle,
    answered,
    async_from_url,
    broker_error,
    connect,
    is_cluster,
    subscriber,
)
from broker.directory import Directory, Entry, readable
from broker.envelope import Envelope
from broker.errors import (
    BrokerUnavailable,
    CallFailed,
    DecodeError,
    HermesError,
    InvalidSpec,
    QueueFull,
    UnknownTool,
)
from broker.states import TERMINAL, State
from broker.toolspec import ToolSpec
from hermes_gateway.aio_handle import AsyncBatch, AsyncCallHandle
from hermes_gateway.clientcore import (
    CANCEL_FIELDS,
    ENDED_KEPT,
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
from hermes_gateway.tracing import Sending

if TYPE_CHECKING:
    from hermes_gateway.batches import AsyncBatchJob

log = structlog.get_logger("hermes.client")

CLUSTER_POLL = 0.05  # seconds the event task waits on the sharded channels per round, on a cluster
SUBSCRIBE_WAIT = 5.0  # seconds to wait for the server to confirm new sharded subscriptions


class AsyncGateway:
    """An asyncio client of the gateway: one connection, one event channel, one pub/sub task."""

    def __init__(
        self, conn: aioredis.Redis, settings: Settings, *, broker: BrokerHandle | None = None,
        url: str | None = None, check_workers: bool = False,
    ) -> None:
        self.conn = conn
        self.url = url or (broker.url if broker is not None else None)  # (batches run on a threaded client)
        self._batches: Any = None  # that client, made on the first batch
        self.settings = settings
        durability.check_supported(conn, settings)
        self.broker = broker  # the broker connect() found (closed with this client), if it made one
        # (Gateway's worker check, on the broker's sync connection, run in a thread)
        self.workers = WorkerCheck(broker, settings, check_workers) if broker is not None else None
        self.client_id = uuid.uuid4().hex
        self.channel = keys.caller_channel(self.client_id)
        self.cluster = is_cluster(conn)
        self._channels = {self.channel}
        self._wanted: set[str] = set()
        self._confirmed: dict[str, asyncio.Event] = {}
        self.calls = Calls(conn)  # type: ignore[arg-type]
        self.calls.keep_history = settings.workers.keep_history
        self.router: Router[AsyncCallHandle] = Router(keep_ended=ENDED_KEPT)  # (+ our calls that ended lately)
        self._tools: dict[str, Entry] = {}
        self._tools_gen = 0  # bumped by every change notice: a fetch that raced one is not cached
        self._tools_channel = keys.channel(conn, keys.TOOLS_CHANNEL).encode()
        self._pubsub = subscriber(conn)
        self._task: asyncio.Task[None] | None = None
        self._catch_up_due = False

    @classmethod
    async def connect(
        cls, url: str | None = None, *, home: str | None = None, embedded_ok: bool = True, check_workers: bool = True
    ) -> AsyncGateway:
        """Connect and subscribe, as ``Gateway.connect`` does (``check_workers`` too)."""
        settings = load_settings(home)
        # (may start a child process, the embedded broker: once, up front)
        broker = await asyncio.to_thread(find_broker, settings, url, embedded_ok=embedded_ok)
        try:
            conn = await async_from_url(broker.url)
            gw = cls(conn, settings, broker=broker, url=broker.url, check_workers=check_workers)
            await gw.start()
        except BaseException:
            broker.close()
            raise
        return gw

    async def start(self) -> None:
        """Subscribe before any submission, so no event of ours can be published unheard."""
        self._catch_up_due = False
        if self.cluster:
            for text_ in scripts.PIPELINED:  # a cluster pipeline cannot load a script a node lacks
                await self.conn.script_load(text_)
            await self._pubsub.subscribe(self._tools_channel)
        else:
            await self._pubsub.subscribe(self.channel, self._tools_channel)
        # redis-py subscribes again on every reconnect; then every waiting handle reads its history.
        connection = getattr(self._pubsub, "connection", None)
        if connection is not None and hasattr(connection, "register_connect_callback"):
            connection.register_connect_callback(self._on_reconnect)
        self._task = asyncio.create_task(self._dispatch(), name="hermes-aio-events")

    async def close(self) -> None:
        """Stop the event task and close the connection (and the embedded broker, if ours)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()
        await self.conn.aclose()
        if self._batches is not None:
            await asyncio.to_thread(self._batches.close)
        if self.workers is not None:
            await asyncio.to_thread(self.workers.close)
        if self.broker is not None:
            self.broker.close()

    # -- batches (the one model of hermes_gateway/batches.py) and the directory's writes, policy and workers:
    # -- a threaded client's, run in worker threads

    def _threaded(self) -> Any:
        if self._batches is None:
            from hermes_gateway.client import Gateway

            if self.url is None:
                raise HermesError("batches need the broker's URL: AsyncGateway.connect(url) or AsyncGateway(..., url=)")
            self._batches = Gateway(connect(self.url, embedded_ok=False), self.settings)
        return self._batches

    async def batch(self, tool: str, items: Any, *, window: int | None = None, ttl: int | None = None,
                    resume: str | None = None, **context: Any) -> AsyncBatchJob:
        """``Gateway.batch`` for asyncio: the items are sent by a thread (iterate them there, not here)."""
        from hermes_gateway.batches import AsyncBatchJob

        gw = await asyncio.to_thread(self._threaded)
        job = await asyncio.to_thread(lambda: gw.batch(tool, items, window=window, ttl=ttl, resume=resume, **context))
        return AsyncBatchJob(job)

    async def batch_job(self, batch_id: str) -> AsyncBatchJob:
        """A batch made by any process, by id (UnknownBatch when none is on record)."""
        from hermes_gateway.batches import AsyncBatchJob

        return AsyncBatchJob(await asyncio.to_thread(lambda: self._threaded().batch_job(batch_id)))

    async def register_tool(self, spec: ToolSpec | dict[str, Any]) -> int:
        """As ``Gateway.register_tool``: the new version."""
        return int(await asyncio.to_thread(lambda: self._threaded().register_tool(spec)))

    async def tool_schemas(self, principal: str | None = None) -> list[dict[str, Any]]:
        """As ``Gateway.tool_schemas``: the OpenAI function tools ``principal`` may call."""
        return list(await asyncio.to_thread(lambda: self._threaded().tool_schemas(principal)))

    async def policy(self) -> Any:
        """As ``Gateway.policy``: the policy the workers judge by."""
        return await asyncio.to_thread(lambda: self._threaded().policy())

    async def live_workers(self, queue: str | None = None, within: float | None = None) -> list[dict[str, Any]]:
        """As ``Gateway.live_workers``."""
        return list(await asyncio.to_thread(lambda: self._threaded().live_workers(queue, within)))

    async def require_workers(self, queue: str) -> None:
        """As ``Gateway.require_workers``: NoWorkers unless a live worker listens on ``queue``."""
        await asyncio.to_thread(lambda: self._threaded().require_workers(queue))

    async def __aenter__(self) -> AsyncGateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- tools -----------------------------------------------------------------------------------

    async def tool(self, name: str) -> Entry:
        """The directory entry of ``name`` (cached until a change notice); UnknownTool if absent."""
        entry = self._tools.get(name)
        if entry is None:
            generation = self._tools_gen
            pipe = self.conn.pipeline(transaction=False)
            pipe.hget(keys.TOOLS, name)
            pipe.hget(keys.TOOLS_VER, name)
            raw, ver = await pipe.execute()
            if raw is None:
                raise UnknownTool(f"unknown tool {name!r}: it is not in the tool directory", tool=name)
            entry = Entry(ToolSpec.from_stored(unpack(bytes(raw))), int(ver or 0))
            if generation == self._tools_gen:
                self._tools[name] = entry
        return entry

    async def sync_tools(self, path: Any = None, errors: list[InvalidSpec] | None = None) -> list[tuple[str, int, bool]]:
        """As ``Gateway.sync_tools``."""
        if self.broker is None:
            raise HermesError("sync_tools needs a gateway made by AsyncGateway.connect()")
        directory = Directory(self.broker.conn)
        return await asyncio.to_thread(register_dir, directory, path or self.settings.tools_dir, errors)

    async def tools(self) -> list[Entry]:
        """Every directory entry, sorted by name."""
        pipe = self.conn.pipeline(transaction=False)
        pipe.hgetall(keys.TOOLS)
        pipe.hgetall(keys.TOOLS_VER)
        raw, vers = await pipe.execute()
        return readable(raw, vers)  # one entry that does not decode is skipped with a warning

    # -- calls -----------------------------------------------------------------------------------

    async def call_tool(
        self, name: str, args: dict[str, Any] | None = None, *, timeout: float | None = None,
        idempotency_key: str | None = None, max_attempts: int | None = None, traceparent: str | None = None,
        tracestate: str | None = None, queue: str | None = None, fairness_key: str | None = None,
        call_class: str | None = None, **context: Any,
    ) -> AsyncCallHandle:
        """Submit one tool call, as ``Gateway.call_tool``."""
        with answered(f"submitting a call of {name!r}"), Sending(traceparent, tracestate) as send:
            entry = await self.tool(name)
            opts = CallOptions(timeout, idempotency_key, max_attempts, traceparent, tracestate, queue,
                               fairness_key, call_class, trace_headers=send.headers)
            env = tool_envelope(entry, name, args, opts, context, self._channel_of, self.settings)
            send.describe(env)
            return await self._submit(env, tool_limits(env, entry.spec, self.settings))

    async def call_llm(
        self, request: dict[str, Any], *, timeout: float | None = None, idempotency_key: str | None = None,
        max_attempts: int | None = None, traceparent: str | None = None, tracestate: str | None = None,
        queue: str = "llm", fairness_key: str | None = None, call_class: str | None = None, **context: Any,
    ) -> AsyncCallHandle:
        """Submit one LLM call, as ``Gateway.call_llm``."""
        check_llm_request(request, context)
        send = Sending(traceparent, tracestate)
        opts = CallOptions(timeout, idempotency_key, max_attempts, traceparent, tracestate, queue,
                           fairness_key, call_class, trace_headers=send.headers)
        env, limits = llm_envelope(request, self.settings, opts, context, self._channel_of)
        with answered("submitting an LLM call"), send:
            send.describe(env)
            return await self._submit(env, limits)

    async def _ensure_workers(self, queues: Iterable[str]) -> None:
        """``WorkerCheck.ensure``, in a thread when a queue is not trusted yet."""
        queues = tuple(dict.fromkeys(keys.base_queue(q) for q in queues))
        if self.workers is not None and self.workers.unchecked(queues):
            await asyncio.to_thread(self.workers.ensure, queues)

    async def _submit(self, env: Envelope, limits: dict[str, Any]) -> AsyncCallHandle:
        await self._ensure_workers((env.queue,))
        handle = self.router.track(AsyncCallHandle(self, env.call_id, env.name, env.kind))
        try:
            (reply,), acked = await self._send([(env, limits, handle)])
            if isinstance(reply, Exception):
                raise reply
            return await self._settle(env, limits, handle, reply, acked)
        except BaseException:
            self.router.drop(env.call_id)
            raise

    async def _send(self, prepared: list[tuple[Envelope, dict[str, Any], AsyncCallHandle]]) -> tuple[list[Any], Any]:
        """SUBMIT ``prepared`` in one pipeline: their replies (an error in place of a failed one), and
        WAIT's reply (None when not asked for)."""
        await self._subscribed()
        await self._list(dict.fromkeys(env.queue for env, _, _ in prepared))
        pipe = self.conn.pipeline(transaction=False)
        for env, limits, _ in prepared:
            await self.calls.submit(env, pipeline=pipe, **limits)  # type: ignore[arg-type]
        confirm = bool(prepared) and durability.queue_wait(pipe, self.settings)  # (before the wake-up)
        queues = list(dict.fromkeys(keys.base_queue(env.queue) for env, _, _ in prepared))
        await self._wake(pipe, queues)
        sent = await pipe.execute(raise_on_error=False)
        await self._wake(None, queues)
        return sent[: len(prepared)], sent[len(prepared)] if confirm else None

    async def _settle(self, env: Envelope, limits: dict[str, Any], handle: AsyncCallHandle, reply: Any, acked: Any) -> AsyncCallHandle:
        """As ``Gateway._settle`` (the existing call's handle reads its history first)."""
        _, call_id = Calls.check_submit(reply, limits["ckey"], limits["queue_size"], env)
        if call_id != env.call_id:  # idempotent resubmission: follow the call that already exists
            self.router.drop(env.call_id)
            name, kind = Calls.existing_call(reply) or (env.name, env.kind)
            existing = AsyncCallHandle(self, call_id, name, kind, own=False)
            await existing.sync()
            return existing
        if acked is not None:
            await self._confirm(acked, env)
        return handle

    async def _confirm(self, acked: Any, env: Envelope) -> None:
        """Raise BrokerNotDurable, the call cancelled, when WAIT confirmed it on too few replicas."""
        error = durability.shortfall(acked, self.settings, f"call {env.call_id} ({env.name}) not accepted", call_id=env.call_id)
        if error is None:
            return
        try:
            error.details["cancelled"] = await self.cancel(env.call_id)
        except (RedisError, OSError) as e:  # the broker failed meanwhile: the caller is told it may still run
            error.details["cancelled"] = False
            error.message += f"; cancelling it failed too ({e}): gw.handle({env.call_id!r}) finds it if it was kept"
        raise error

    async def map(self, name: str, items: Iterable[dict[str, Any]], **common: Any) -> AsyncBatch:
        """Submit many calls of one tool in one pipelined round trip; refused items raise on ``result()``."""
        return await self.submit_many(((name, args) for args in items), **common)

    async def submit_many(self, calls: Iterable[tuple[str, dict[str, Any]]], **common: Any) -> AsyncBatch:
        """Submit (tool, args) pairs in one pipeline (one round trip: a broker error raises for all of them;
        refused items raise on ``result()``)."""
        with answered("submitting a batch of calls"):
            return await self._submit_many(calls, **common)

    async def _submit_many(self, calls: Iterable[tuple[str, dict[str, Any]]], **common: Any) -> AsyncBatch:
        opts = CallOptions.take(common)
        idempotency_keys: Sequence[str | None] | None = common.pop("idempotency_keys", None)
        calls = list(calls)
        check_batch_keys(common, idempotency_keys, len(calls))
        entries = {name: await self.tool(name) for name in dict.fromkeys(n for n, _ in calls)}  # (UnknownTool first)
        send = Sending(opts.traceparent, opts.tracestate)  # one producer span for the batch
        opts = dataclasses.replace(opts, trace_headers=send.headers)
        prepared: list[tuple[Envelope, dict[str, Any], AsyncCallHandle]] = []
        try:
            for i, (name, args) in enumerate(calls):
                entry = entries[name]
                env = tool_envelope(entry, name, args, opts.item(idempotency_keys, i), common, self._channel_of, self.settings)
                handle = self.router.track(AsyncCallHandle(self, env.call_id, name))
                prepared.append((env, tool_limits(env, entry.spec, self.settings), handle))
            await self._ensure_workers(env.queue for env, _, _ in prepared)
            with send:
                send.describe(prepared[0][0] if prepared else None, len(prepared))
                replies, acked = await self._send(prepared)
        except BaseException:
            for env, _, _ in prepared:
                self.router.drop(env.call_id)
            raise
        batch = AsyncBatch()
        for (env, limits, handle), reply in zip(prepared, replies, strict=True):
            try:
                if isinstance(reply, Exception):
                    raise broker_error("submission failed", reply)
                handle = await self._settle(env, limits, handle, reply, acked)
            except (QueueFull, HermesError) as e:
                self.router.drop(env.call_id)
                handle.refuse(e)
            batch.append(handle)
        return batch

    async def handle(self, call_id: str) -> AsyncCallHandle:
        """A handle on any call by id (for example one submitted by another process)."""
        tracked = self.router.get(call_id)
        if tracked is not None:  # ours and still running: the handle the event task already feeds
            return tracked
        raw = await self.conn.hmget(keys.job(call_id), keys.F_TOOL, keys.F_KIND, keys.F_CHANNEL)
        if raw[1] is None:
            raise CallFailed(f"no such call {call_id}", error_type="unknown_call")
        name, kind, channel = (text(v) if v is not None else "" for v in raw)
        h = AsyncCallHandle(self, call_id, name, kind, own=channel in self._channels)
        if h.own:
            self.router.track(h)
        await h.sync()  # an ended call is untracked again by its terminal event
        return h

    async def cancel(self, call_id: str) -> bool:
        """Cancel by id, as ``Gateway.cancel``; True when the request was recorded."""
        conn = self.conn
        target = CancelTarget.of(call_id, await conn.hmget(keys.job(call_id), *CANCEL_FIELDS))
        if target is None or target.state in TERMINAL:
            return False
        info = target.info
        retrying = target.state == State.RETRYING  # (between attempts: no worker holds it either)
        if retrying or (
            target.state == State.PENDING and await conn.zscore(keys.leases(keys.tag(info.queue)), call_id) is None
        ):
            error = RETRYING_CANCEL if retrying else PENDING_CANCEL
            reply = await self.calls.cancel_unleased(info, attempt=target.attempt, error=error, retrying=retrying)
            if int(reply[0]) > 0:
                from broker.audit import AuditLog

                sensitive: tuple[str, ...] = ()
                if info.kind == "tool":
                    with contextlib.suppress(HermesError):  # removed meanwhile: still redacted by name
                        sensitive = (await self.tool(info.name)).spec.sensitive
                audit: Any = AuditLog.from_settings(conn, self.settings.audit)
                await audit.append(target.audit_record(sensitive, error))
                return True
        await conn.hset(keys.job(call_id), keys.F_CANCEL, "1")
        await conn.publish(keys.channel(conn, keys.CONTROL_CHANNEL), pack({"op": "cancel", "call_id": call_id}))
        return True

    # -- events ----------------------------------------------------------------------------------

    def _channel_of(self, queue: str) -> str:
        """The channel of this client's calls on ``queue``: its one channel on a plain Redis; on a cluster
        its sharded channel of the queue's tag (subscribed by ``_subscribed`` before the call is sent)."""
        if not self.cluster:
            return self.channel
        ch = keys.caller_channel(self.client_id, keys.tag(queue))
        if ch not in self._channels:
            self._wanted.add(ch)
        return ch

    async def _subscribed(self) -> None:
        """On a cluster: SSUBSCRIBE the channels new envelopes named, and wait for the server to confirm
        them, so no event of those calls is published unheard."""
        wanted, self._wanted = self._wanted - self._channels, set()
        if not wanted:
            return
        events = [self._confirmed.setdefault(ch, asyncio.Event()) for ch in wanted]
        await self._pubsub.ssubscribe(*wanted)
        self._channels |= wanted
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), SUBSCRIBE_WAIT)
        except TimeoutError as e:
            raise BrokerUnavailable(f"the broker did not confirm the subscriptions {sorted(wanted)} in time") from e

    async def _list(self, queues: Iterable[str]) -> None:
        """Add ``queues`` to RQ's set of queues, once per process (``Calls.listed`` remembers them)."""
        for queue in queues:
            if queue not in self.calls.listed:
                await self.conn.sadd(keys.RQ_QUEUES, keys.queue(queue))
                self.calls.listed.add(queue)

    async def _wake(self, pipe: Any, queues: Iterable[str]) -> None:
        """Wake the workers of ``queues``: in the submission's pipeline on a plain Redis, after it on a
        cluster (``pipe`` None; a cluster pipeline carries no PUBLISH)."""
        if (pipe is None) != self.cluster:
            return
        for queue in queues:
            channel = self.calls.wake_channel(queue)
            if pipe is not None:
                pipe.publish(channel, b"")
            else:
                await self.conn.publish(channel, b"")

    def invalidate(self, name: str) -> None:
        """Forget the cached spec of ``name`` (this process changed it; the notice may come later)."""
        self._tools_gen += 1
        self._tools.pop(name, None)

    def _on_reconnect(self, connection: Any) -> None:
        """redis-py's connect callback of the subscription (after its own, which subscribes again)."""
        self._catch_up_due = True

    async def catch_up(self) -> None:
        """Read the history of every call still waited on, in one round trip (as ``Gateway.catch_up``)."""
        pending = self.router.waiting()
        if not pending:
            return
        pipe = self.conn.pipeline(transaction=False)
        self.router.read_history(pipe, pending)
        self.router.feed_history(pending, await pipe.execute())

    async def _next_message(self) -> Any:
        """The next message: on a cluster the directory's notices, then the sharded channels in turn."""
        if not self.cluster:
            return await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        msg = await self._pubsub.get_message(timeout=0.0)
        if msg is None and self._pubsub.shard_channels:
            msg = await self._pubsub.get_sharded_message(timeout=CLUSTER_POLL)
        elif msg is None:
            await asyncio.sleep(CLUSTER_POLL)
        if msg is not None and msg["type"] == "ssubscribe":
            self._confirmed.setdefault(text(msg["channel"]), asyncio.Event()).set()
        return msg if msg is None or msg["type"] in ("message", "smessage") else None

    async def _dispatch(self) -> None:
        while True:
            try:
                msg = await self._next_message()
                if self._catch_up_due:  # (the subscription is back: what was published meanwhile is lost)
                    self._catch_up_due = False
                    await self.catch_up()
            except (RedisError, OSError) as e:
                if not self._catch_up_due:  # one line per outage, not one per retry
                    log.warning("event subscription interrupted; handles fall back to the history", error=str(e))
                self._catch_up_due = True
                await asyncio.sleep(0.2)
                continue
            try:
                if msg is not None:
                    await self._route(msg["channel"], msg["data"])
            except Exception as e:  # noqa: BLE001 - one bad message must not end the event task
                log.warning("event message skipped", channel=msg.get("channel"), error=f"{type(e).__name__}: {e}")

    async def _route(self, channel: bytes, data: bytes) -> None:
        if channel == self._tools_channel:
            self.invalidate(data.decode(errors="replace"))
        elif (routed := ev_mod.for_handle(self.router.handles, data)) is not None:
            event, handle, gap = routed
            if gap:
                try:
                    await handle.sync()  # fill it from the durable history
                except (RedisError, OSError, DecodeError) as e:
                    log.warning("could not fill an event gap from the history", error=str(e))
            handle.feed(event)  # the terminal event untracks the handle
