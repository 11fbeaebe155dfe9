"""The events side of ``AsyncGateway``: its subscription and the task that feeds events to handles; on a
cluster the sharded channel of each queue tag it uses, subscribed before a call there is sent."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import structlog
from redis import RedisError

from broker import events as ev_mod
from broker import keys
from broker.errors import BrokerUnavailable, DecodeError

if TYPE_CHECKING:
    from broker.calls import Calls
    from broker.directory import Entry
    from hermes_gateway.aio_handle import AsyncCallHandle

CLUSTER_POLL = 0.05  # seconds the event task waits on the sharded channels per round, on a cluster
# Ended calls of ours whose handles (every event heard) are kept for a later `handle(id)`: the HTTP API
# streams a call's events after submitting it, and by then a quick call may have ended.
ENDED_KEPT = 1000
SUBSCRIBE_WAIT = 5.0  # seconds to wait for the server to confirm new sharded subscriptions

log = structlog.get_logger("hermes.client")


class AsyncEvents:
    """The part of ``hermes_gateway.aio.AsyncGateway`` that hears events (it provides these attributes)."""

    conn: Any
    calls: Calls
    client_id: str
    channel: str
    cluster: bool
    _channels: set[str]
    _wanted: set[str]
    _confirmed: dict[str, asyncio.Event]
    _pubsub: Any
    _tools_channel: bytes
    _tools: dict[str, Entry]
    _tools_gen: int
    _handles: dict[str, AsyncCallHandle]
    _ended: OrderedDict[str, AsyncCallHandle]
    _catch_up_due: bool

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
        """Add ``queues`` to RQ's set of queues, once per process (as ``Calls.list_queue``)."""
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

    # -- events ----------------------------------------------------------------------------------

    def _track(self, handle: AsyncCallHandle) -> AsyncCallHandle:
        self._handles[handle.call_id] = handle
        return handle

    def _untrack(self, handle: AsyncCallHandle) -> None:
        if self._handles.get(handle.call_id) is handle:
            del self._handles[handle.call_id]
            if handle.done():  # kept a while: an ended call's stored history is its last event alone
                self._ended[handle.call_id] = handle
                while len(self._ended) > ENDED_KEPT:
                    self._ended.popitem(last=False)

    def invalidate(self, name: str) -> None:
        """Forget the cached spec of ``name`` (this process changed it; the notice may come later)."""
        self._tools_gen += 1
        self._tools.pop(name, None)

    def _on_reconnect(self, connection: Any) -> None:
        """redis-py's connect callback of the subscription (after its own, which subscribes again)."""
        self._catch_up_due = True

    async def catch_up(self) -> None:
        """Read the durable history of every call still waited on, in one pipelined round trip.

        Done by the event task when its subscription comes back after a broker restart or a dropped
        connection (as ``Gateway.catch_up``): the events published meanwhile went nowhere.
        """
        pending = [h for h in self._handles.values() if not h.done()]
        if not pending:
            return
        pipe = self.conn.pipeline(transaction=False)
        for h in pending:  # (with the last event: an ended call's history is that event alone)
            pipe.lrange(keys.history(h.call_id), h.last_seq, -1)
            pipe.lindex(keys.history(h.call_id), -1)
        stored = await pipe.execute()
        for i, h in enumerate(pending):
            for event in ev_mod.unseen(stored[2 * i], stored[2 * i + 1], h.last_seq):
                h._feed(event)

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
            self._confirmed.setdefault(_text(msg["channel"]), asyncio.Event()).set()
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
            if msg is None:
                continue
            try:
                await self._route(msg["channel"], msg["data"])
            except Exception as e:  # noqa: BLE001 - one bad message must not end the event task
                log.warning("event message skipped", channel=msg.get("channel"), error=f"{type(e).__name__}: {e}")

    async def _route(self, channel: bytes, data: bytes) -> None:
        if channel == self._tools_channel:
            self._tools_gen += 1
            self._tools.pop(data.decode(errors="replace"), None)
            return
        routed = ev_mod.for_handle(self._handles, data)
        if routed is None:
            return
        event, handle, gap = routed
        if gap:
            try:
                await handle.sync()  # fill it from the durable history
            except (RedisError, OSError, DecodeError) as e:
                log.warning("could not fill an event gap from the history", error=str(e))
        handle._feed(event)  # the terminal event untracks the handle


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")
