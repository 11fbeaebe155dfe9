"""The asyncio client: the ``Gateway`` surface on ``redis.asyncio``, with no threads; a face over
``hermes_gateway.clientcore`` as ``Gateway`` is. One pub/sub task feeds every handle."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import TYPE_CHECKING, Any, cast

import redis.asyncio as aioredis
import structlog
from redis import RedisError

from broker import events as ev_mod
from broker import keys, pipes, scripts
from broker.codec import text, unpack
from broker.config import Settings, load_settings
from broker.connection import BrokerHandle, answered, async_from_url, connect
from broker.directory import Directory, Entry, readable
from broker.envelope import Envelope
from broker.errors import BrokerUnavailable, HermesError, InvalidSpec, UnknownTool
from broker.toolspec import ToolSpec
from hermes_gateway.aio_handle import AsyncBatch, AsyncCallHandle
from hermes_gateway.clientcore import (
    ENDED_KEPT,
    LIVE_GRACE,
    CallOptions,
    ClientCore,
    WorkerCheck,
    await_steps,
    find_broker,
    register_dir,
)

if TYPE_CHECKING:
    from hermes_gateway.batches import AsyncBatchJob

log = structlog.get_logger("hermes.client")

CLUSTER_POLL = 0.05  # seconds the event task waits on the sharded channels per round, on a cluster
SUBSCRIBE_WAIT = 5.0  # seconds to wait for the server to confirm new sharded subscriptions


class AsyncGateway(ClientCore[AsyncCallHandle]):
    """An asyncio client of the gateway: one connection, one event channel, one pub/sub task."""

    def __init__(
        self, conn: aioredis.Redis, settings: Settings, *, broker: BrokerHandle | None = None,
        url: str | None = None, check_workers: bool = False,
    ) -> None:
        self.url = url or (broker.url if broker is not None else None)  # (batches run on a threaded client)
        self._batches: Any = None  # that client, made on the first batch
        super().__init__(conn, settings, keep_ended=ENDED_KEPT)  # (the router keeps our calls that ended lately)
        self.broker = broker  # the broker connect() found (closed with this client), if it made one
        # (Gateway's worker check, on the broker's sync connection, run in a thread)
        self.workers = WorkerCheck(broker, settings, check_workers) if broker is not None else None
        self._wanted: set[str] = set()
        self._confirmed: dict[str, asyncio.Event] = {}  # set by the event task when a subscription is confirmed
        self._pubsub.ignore_subscribe_messages = False  # (it reads the confirmations: ``_next_message``)
        # Other clients' calls: one handle each while anyone holds it, and the channels of those followed
        # (``following``) with how many such calls each carries.
        self._foreign: weakref.WeakValueDictionary[str, AsyncCallHandle] = weakref.WeakValueDictionary()
        self._follows: Counter[str] = Counter()
        self._tools: dict[str, Entry] = {}
        self._tools_gen = 0  # bumped by every change notice: a fetch that raced one is not cached
        self._task: asyncio.Task[None] | None = None

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
        if self.cluster:  # (a cluster pipeline cannot load a script a node lacks)
            for text_ in scripts.PIPELINED:
                await self.conn.script_load(text_)
        await self._pubsub.subscribe(self._tools_channel, *([] if self.cluster else [self.channel]))
        self._watch_reconnects()
        self._task = asyncio.create_task(self._dispatch(), name="hermes-aio-events")

    async def close(self) -> None:
        """Stop the event task and close the connection (and the embedded broker, if ours)."""
        if self.shut:
            return
        self.shutting()
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
        opts = CallOptions(timeout, idempotency_key, max_attempts, traceparent, tracestate, queue, fairness_key, call_class)
        return await await_steps(self._call_tool(name, args, opts, context))

    async def call_llm(
        self, request: dict[str, Any], *, timeout: float | None = None, idempotency_key: str | None = None,
        max_attempts: int | None = None, traceparent: str | None = None, tracestate: str | None = None,
        queue: str = "llm", fairness_key: str | None = None, call_class: str | None = None, **context: Any,
    ) -> AsyncCallHandle:
        """Submit one LLM call, as ``Gateway.call_llm``."""
        opts = CallOptions(timeout, idempotency_key, max_attempts, traceparent, tracestate, queue, fairness_key, call_class)
        return await await_steps(self._call_llm(request, opts, context))

    async def map(self, name: str, items: Iterable[dict[str, Any]], **common: Any) -> AsyncBatch:
        """Submit many calls of one tool in one pipelined round trip; refused items raise on ``result()``."""
        return await self.submit_many(((name, args) for args in items), **common)

    async def submit_many(self, calls: Iterable[tuple[str, dict[str, Any]]], **common: Any) -> AsyncBatch:
        """Submit (tool, args) pairs in one pipeline (one round trip: a broker error raises for all of them;
        refused items raise on ``result()``)."""
        calls = list(calls)
        with answered("submitting a batch of calls"):
            batch = await await_steps(self._submit_many(calls, common, AsyncBatch(), max(1, len(calls))))
        return cast(AsyncBatch, batch)

    async def handle(self, call_id: str) -> AsyncCallHandle:
        """A handle on any call by id (for example one submitted by another process)."""
        return await await_steps(self._lookup(call_id))

    async def cancel(self, call_id: str) -> bool:
        """Cancel by id, as ``Gateway.cancel``; True when the request was recorded."""
        with answered(f"cancelling call {call_id}"):
            return await await_steps(self._cancel(call_id))

    def _new_handle(self, call_id: str, name: str, kind: str = "tool", *, own: bool = True) -> AsyncCallHandle:
        handle = AsyncCallHandle(self, call_id, name, kind, own=own)
        if own:
            return handle
        # (an idempotent resubmission of a call of ours that runs: the handle its events feed; else one
        # handle a call, that its followers share)
        return self.router.handles.get(call_id) or self._foreign.setdefault(call_id, handle)

    @contextlib.asynccontextmanager
    async def following(self, handle: AsyncCallHandle) -> AsyncIterator[None]:
        """Hear another client's call live while in the block (its history, polled, is trimmed to the end
        when it ends, and the events just before are lost): the handle is routed to, and the channel its
        events are published on is subscribed, confirmed before the history is read again, so each event
        is heard or read. Counted: the handle, and a channel several followed calls share, go with the last."""
        if handle.own or handle.done():
            yield
            return
        raw = await self.conn.hget(keys.job(handle.call_id), keys.F_CHANNEL)
        channel = text(raw) if raw is not None and text(raw) not in self._channels else None  # (None: ended, or ours)
        handle.followers += 1
        self.router.track(handle)
        try:
            if channel is not None:
                self._follows[channel] += 1
                if self._follows[channel] == 1:
                    self._confirmed[channel] = asyncio.Event()
                    await (self._pubsub.ssubscribe if self.cluster else self._pubsub.subscribe)(channel)
                with contextlib.suppress(TimeoutError):  # (unconfirmed: the history is still read every second)
                    await asyncio.wait_for(self._confirmed[channel].wait(), SUBSCRIBE_WAIT)
            await handle.sync(LIVE_GRACE)
            yield
        finally:
            handle.followers -= 1
            if not handle.followers:
                self.router.drop(handle.call_id, handle)
            if channel is not None:
                self._follows[channel] -= 1
                if not self._follows[channel]:
                    del self._follows[channel], self._confirmed[channel]
                    with contextlib.suppress(RedisError, OSError):
                        if not self.shut:
                            await (self._pubsub.sunsubscribe if self.cluster else self._pubsub.unsubscribe)(channel)

    async def _ensure_workers(self, queues: Iterable[str]) -> None:
        """``WorkerCheck.ensure``, in a thread when a queue is not trusted yet."""
        queues = tuple(dict.fromkeys(keys.base_queue(q) for q in queues))
        if self.workers is not None and self.workers.unchecked(queues):
            await asyncio.to_thread(self.workers.ensure, queues)

    async def _send_chunk(self, chunk: list[tuple[Envelope, dict[str, Any], AsyncCallHandle]]) -> tuple[list[Any], Any]:
        await self._subscribed()
        await self._list(dict.fromkeys(env.queue for env, _, _ in chunk))
        return await await_steps(self.pipelined(chunk, self._patient))

    def _patient(self, pipe: Any) -> Awaitable[list[Any]]:
        return pipes.resent(pipe, pipes.for_seconds(pipes.SUBMIT_PATIENCE))

    # -- events ----------------------------------------------------------------------------------

    def channel_for(self, queue: str) -> str:
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

    def invalidate(self, name: str) -> None:
        """Forget the cached spec of ``name`` (this process changed it; the notice may come later)."""
        self._tools_gen += 1
        self._tools.pop(name, None)

    async def catch_up(self) -> None:
        """Read the history of every call still waited on, in pipelined round trips (as ``Gateway.catch_up``)."""
        await await_steps(self._catch_up())

    async def _next_message(self) -> Any:
        """The next message: on a cluster the directory's notices, then the sharded channels in turn."""
        msg = await self._pubsub.get_message(timeout=0.0 if self.cluster else 1.0)
        if msg is None and self._pubsub.shard_channels:
            msg = await self._pubsub.get_sharded_message(timeout=CLUSTER_POLL)
        elif msg is None and self.cluster:
            await asyncio.sleep(CLUSTER_POLL)
        if msg is not None and msg["type"] in ("subscribe", "ssubscribe") and text(msg["channel"]) in self._confirmed:
            self._confirmed[text(msg["channel"])].set()
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
            if gap and not await await_steps(self._fill_gap(handle, event)):
                return
            handle.feed(event)  # the terminal event untracks the handle
