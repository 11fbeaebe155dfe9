"""The events side of ``Gateway``: its subscription, the thread that feeds events to handles, and on a
cluster the sharded channel of each queue tag it uses."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import redis
import structlog

from broker import events as ev_mod
from broker import keys, pipes
from broker.codec import text
from broker.errors import BrokerUnavailable

if TYPE_CHECKING:
    from broker.directory import Directory
    from hermes_gateway.handle import CallHandle

# How long the event thread reads the subscription directly with nothing arriving before it goes back to
# redis-py's reader (which keeps the connection's health checks).
DIRECT_READ_IDLE = 1.0
CLUSTER_POLL = 0.05  # seconds a cluster client's event thread waits on its sharded channels per round
SUBSCRIBE_WAIT = 5.0  # seconds to wait for the server to confirm a new sharded subscription
log = structlog.get_logger("hermes.client")
CATCH_UP_CHUNK = 500  # history reads per pipelined round trip when the subscription comes back


class ClientEvents:
    """The part of ``hermes_gateway.client.Gateway`` that hears events (it provides these attributes)."""

    client_id: str
    channel: str
    cluster: bool
    directory: Directory
    _channels: set[str]
    _confirmed: dict[str, threading.Event]
    _sub_lock: threading.Lock
    _pubsub: Any
    _tools_channel: bytes
    _handles: dict[str, CallHandle]
    _lock: threading.Lock
    _closed: threading.Event
    _catch_up_due: bool
    conn: Any

    def channel_for(self, queue: str) -> str:
        """The channel this client hears the events of its calls on ``queue`` on: its one channel on a
        plain Redis; on a cluster its sharded channel of the queue's tag, subscribed (and confirmed by
        the server) before the first call there is sent, so no event of it goes unheard."""
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
        """Read the durable history of every call still waited on, in pipelined round trips.

        Done by the event thread when its subscription comes back after a broker restart or a dropped
        connection: the events published meanwhile went nowhere, and waiting for each handle's own
        resync would cost a second per handle waited on in turn. Raises the broker's error (the next
        reconnect tries again).
        """
        with self._lock:
            pending = [h for h in self._handles.values() if not h.done()]
        for start in range(0, len(pending), CATCH_UP_CHUNK):
            chunk = pending[start : start + CATCH_UP_CHUNK]
            pipe = self.conn.pipeline(transaction=False)
            for h in chunk:  # (with the last event: an ended call's history is that event alone)
                pipe.lrange(keys.history(h.call_id), h.last_seq, -1)
                pipe.lindex(keys.history(h.call_id), -1)
            try:
                stored = pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError):
                self._catch_up_due = True
                raise
            for i, h in enumerate(chunk):
                for event in ev_mod.unseen(stored[2 * i], stored[2 * i + 1], h.last_seq):
                    h._feed(event)

    def _dispatch_cluster(self) -> None:
        """A cluster's loop: the directory's notices (plain pub/sub) and the sharded channels of the
        queue tags in use, read in turn (redis-py follows a sharded channel to its slot's new node)."""
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
        """Read published messages off the subscribed connection until it has been idle for a while.

        Per message this skips the layers of ``PubSub.get_message`` (retry wrapper, health-check
        bookkeeping, message dicts), which under load cost more than handling the event. A health-check
        answer read here is counted as ``get_message`` would; any trouble goes back to ``get_message``.
        """
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
