"""The Gateway client: submit tool and LLM calls, follow their events, get typed results (a face over
``hermes_gateway.clientcore``, with one thread that hears events)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import redis
import structlog

from broker import events as ev_mod
from broker import keys, pipes
from broker.codec import text
from broker.config import Settings, load_settings
from broker.connection import BrokerHandle, answered
from broker.directory import Directory, Entry
from broker.envelope import Envelope
from broker.errors import BrokerUnavailable, InvalidSpec
from broker.toolspec import ToolSpec
from hermes_gateway.clientcore import (
    CallOptions,
    ClientCore,
    WorkerCheck,
    find_broker,
    register_dir,
    run_steps,
)
from hermes_gateway.handle import Batch, CallHandle

if TYPE_CHECKING:
    from hermes_gateway.batches import BatchJob

log = structlog.get_logger("hermes.client")

SUBMIT_CHUNK = 100  # calls per pipelined round trip in submit_many
DIRECT_READ_IDLE = 1.0  # seconds of quiet before the event thread goes back to redis-py's reader
CLUSTER_POLL = 0.05  # seconds a cluster client's event thread waits on its sharded channels per round
SUBSCRIBE_WAIT = 5.0  # seconds to wait for the server to confirm a new sharded subscription


def _function_tool(spec: ToolSpec) -> dict[str, Any]:
    """One tool in the chat-completions ``tools`` shape."""
    parameters = dict(spec.input_schema)
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})  # (some providers refuse an object schema without it)
    return {
        "type": "function",
        "function": {"name": spec.name, "description": spec.description, "parameters": parameters},
    }


class Gateway(ClientCore[CallHandle]):
    """A client of the gateway: one connection, one event channel, many calls in flight."""

    def __init__(
        self, handle: BrokerHandle, settings: Settings | None = None, *, check_workers: bool = False
    ) -> None:
        self.broker = handle
        self.conn: redis.Redis
        self.settings = settings or load_settings()
        self.workers = WorkerCheck(handle, self.settings, check_workers)
        pipes.configure(self.settings.broker.fast_path)
        super().__init__(handle.conn, self.settings)
        self.directory = Directory(self.conn)
        self._closed = threading.Event()
        # On a cluster, events come on one sharded channel per queue tag used (``channel_for``).
        self._confirmed: dict[str, threading.Event] = {}
        self._sub_lock = threading.Lock()
        self._pubsub.subscribe(self._tools_channel, *([] if self.cluster else [self.channel]))
        self._watch_reconnects()
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
        self.shutting()
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
        opts = CallOptions(timeout, idempotency_key, max_attempts, traceparent, tracestate, queue, fairness_key, call_class)
        return run_steps(self._call_tool(name, args, opts, context))

    def call_llm(
        self, request: dict[str, Any], *, timeout: float | None = None, idempotency_key: str | None = None,
        max_attempts: int | None = None, traceparent: str | None = None, tracestate: str | None = None,
        queue: str = "llm", fairness_key: str | None = None, call_class: str | None = None, **context: Any,
    ) -> CallHandle:
        """Submit one LLM call (chat-completions kwargs) to config.yaml's ``model:`` (``request["model"]``
        overrides ``model.model``): events carry stream deltas, the result is the response."""
        opts = CallOptions(timeout, idempotency_key, max_attempts, traceparent, tracestate, queue, fairness_key, call_class)
        return run_steps(self._call_llm(request, opts, context))

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
            return cast(Batch, run_steps(self._submit_many(calls, common, Batch(), SUBMIT_CHUNK)))

    def _new_handle(self, call_id: str, name: str, kind: str = "tool", *, own: bool = True) -> CallHandle:
        return CallHandle(self, call_id, name, kind, own=own)

    def _ensure_workers(self, queues: Iterable[str]) -> None:
        self.workers.ensure(queues)

    def _send_chunk(self, chunk: list[tuple[Envelope, dict[str, Any], CallHandle]]) -> tuple[list[Any], Any]:
        return run_steps(self.pipelined(chunk, self._patient))

    def _patient(self, pipe: Any) -> list[Any]:
        return pipes.execute(pipe, keep_trying=pipes.for_seconds(pipes.SUBMIT_PATIENCE))

    def cancel(self, call_id: str) -> bool:
        """Cancel by id; True when the request was recorded (the call was not already finished). A call no
        worker has taken ends here (with its audit record); a leased one's worker is told to stop it."""
        with answered(f"cancelling call {call_id}"):
            return run_steps(self._cancel(call_id))

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
        return run_steps(self._lookup(call_id))

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
        """The event thread: rounds of ``_pump`` (``_pump_cluster`` on a cluster) until the client closes."""
        pump, pause = (self._pump_cluster, 0.5) if self.cluster else (self._pump, 0.2)
        while not self._closed.is_set():
            try:
                pump()
            except (redis.ConnectionError, redis.TimeoutError, ValueError):
                if self._closed.is_set():
                    return
                time.sleep(pause)

    def _pump(self) -> None:
        # redis-py's reader reconnects, subscribes again and sends health checks ...
        msg = self._pubsub.get_message(timeout=0.5)
        if self._catch_up_due:  # (the subscription is back: what was published meanwhile is lost)
            self._catch_up_due = False
            self.catch_up()
        if msg is not None and not self._closed.is_set():
            self._on_message(msg["channel"], msg["data"])
        # ... and while the subscription is up and busy, messages are read straight off it.
        self._read_direct()

    def catch_up(self) -> None:
        """Read the durable history of every call still waited on, in pipelined round trips (when the
        subscription comes back: what was published meanwhile is lost). Raises the broker's error (and
        catches up again on the next round)."""
        try:
            run_steps(self._catch_up())
        except (redis.ConnectionError, redis.TimeoutError):
            self._catch_up_due = True
            raise

    def _pump_cluster(self) -> None:
        """A cluster's round: the directory's notices and the sharded channels of the queue tags, in turn."""
        pubsub = self._pubsub
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
                if gap and not run_steps(self._fill_gap(handle, event)):
                    return
                handle.feed(event)  # the terminal event untracks the handle
        except Exception as e:  # noqa: BLE001 - one bad message must not stop the event thread
            log.warning("event message skipped", channel=channel, error=f"{type(e).__name__}: {e}")
