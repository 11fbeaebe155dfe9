"""A worker process: claims calls from RQ queues and keeps up to N of them in flight on threads; registers as
an RQ worker, heartbeats, extends its calls' leases, reaps dead workers' calls and drains on SIGTERM."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import redis
import structlog
from rq import Queue
from rq import Worker as RQWorker
from rq.worker import WorkerStatus

from broker import durability, keys, logs, pipes
from broker.calls import Calls
from broker.codec import MsgpackSerializer, pack, unpack
from broker.config import Settings
from broker.connection import is_cluster, subscriber
from broker.settings import configure_shortcuts, shortcut_on
from workers import reaper
from workers.runner import CallRunner, WorkerCore
from workers.stopping import drain

log = structlog.get_logger("hermes.worker")


try:
    VERSION = version("hermes-gateway")
except PackageNotFoundError:
    VERSION = "unknown"

CLAIM_BATCH = 64
# Submissions publish a wake-up; polling is the fallback for a lost message.
IDLE_POLL_MIN = 0.01
IDLE_POLL_MAX = 0.5
# Beyond wait_timeout_ms, how long a caller may take to cancel a submission its replicas did not confirm.
UNCONFIRMED_MARGIN = 1.0


def rq_time(raw: Any) -> float:
    """A record's RQ timestamp (``2026-01-02T03:04:05.123456Z``) as unix seconds; 0 when absent or unreadable."""
    try:
        stamp = raw.decode() if isinstance(raw, bytes) else str(raw)
        return datetime.strptime(stamp.rstrip("Z"), "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=UTC).timestamp()
    except (AttributeError, ValueError):
        return 0.0


def worker_name() -> str:
    return f"hermes-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    """One worker process."""

    def __init__(
        self, conn: redis.Redis, settings: Settings, queues: list[str], concurrency: int = 16,
        name: str | None = None, grace: float = 25.0,
    ) -> None:
        durability.check_supported(conn, settings)
        self.conn = conn
        self.settings = settings
        self.queues = queues
        self.concurrency = max(1, concurrency)
        self.name = name or worker_name()
        self.grace = grace
        self.lease = settings.workers.lease
        configure_shortcuts(settings.workers.shortcuts_off)  # (before anything a call runs through)
        self.core = WorkerCore(conn, settings, self.name)
        self.runner = CallRunner(self.core)
        self.pool = call_threads(self.concurrency, "hermes-call")
        self.stopping = threading.Event()
        self._slots = Tokens(self.concurrency)  # one per call this process may run at once
        self._wake = threading.Event()
        self._beat_now = threading.Event()
        self.claim_queues = list(queues)  # and the partitions of their tools (``refresh_queues``)
        self._turn = 0
        self.core.scheduler.queues = self.claim_queues
        # Registered as an RQ worker (``rq info`` lists it) on a plain Redis; RQ knows no Redis Cluster.
        self.rq = None if is_cluster(conn) else RQWorker(
            [Queue(keys.tag(q), connection=conn, serializer=MsgpackSerializer) for q in queues],
            connection=conn, name=self.name, serializer=MsgpackSerializer,
        )
        self.started_at = time.time()
        # With ``wait_replicas``, claims go on a connection of their own (WAIT confirms its own writes).
        self._claims = self.core.calls
        if settings.broker.wait_replicas > 0:
            own = redis.Redis(connection_pool=conn.connection_pool, single_connection_client=True)
            self._claims = Calls(own)
        self._unconfirmed_logged = 0.0
        self._claim_conn: Any = None  # the dispatcher's own connection for its claims (taken once)
        self._peers: dict[str, int] = {}  # live workers per queue, read with each heartbeat
        self.tool_notices = 0  # directory change notices heard (the heartbeat reports it)
        # A call ending here takes the next one of its queue in the same script (not with wait_replicas:
        # claims wait for the replicas there, see _confirm_claims).
        if settings.broker.wait_replicas <= 0:
            self.runner.next_call, self.runner.took = self._next_call, self._took

    def _claim_connection(self) -> Any:
        """The dispatcher's kept connection (its claims skip the pool); None where the claims need their own
        client (``wait_replicas``)."""
        if self._claim_conn is None and self._claims is self.core.calls and hasattr(self.conn, "connection_pool"):
            self._claim_conn = self.conn.connection_pool.get_connection()
        return self._claim_conn

    def request_stop(self) -> None:
        self.stopping.set()
        self._wake.set()
        self._beat_now.set()

    def work(self) -> None:
        """Run until stopped; then drain within the grace period."""
        if self.rq is not None:
            self.rq.register_birth()
            self.rq.set_state(WorkerStatus.IDLE)  # busy while a call runs: each heartbeat says which
        self.core.calls.load_scripts()
        self._heartbeat_once()
        try:
            self.refresh_queues()
        except redis.RedisError as e:
            log.warning("could not read the tool directory yet", error=str(e))
        threads = [
            threading.Thread(target=self._heartbeat_loop, name="hermes-heartbeat", daemon=True),
            threading.Thread(target=self._control_loop, name="hermes-control", daemon=True),
            threading.Thread(  # due retries back to pending: a call waiting for its retry holds no thread
                target=self.core.scheduler.run, args=(self.stopping,), name="hermes-retry", daemon=True
            ),
        ]
        for t in threads:
            t.start()
        log.info(
            "worker started",
            worker=self.name,
            queues=self.queues,
            concurrency=self.concurrency,
            pid=os.getpid(),
            **({"shortcuts_off": sorted(off)} if (off := self.settings.workers.shortcuts_off) else {}),
        )
        for problem in self.settings.unknown_keys:
            log.warning(problem)
        for key, name in self.settings.unset_vars:  # (as docker compose says it: it reads as empty)
            log.warning("config.yaml names a variable not set in this worker's environment: it reads as empty",
                        key=key, variable=f"${{{name}}}")
        logs.flush()  # (the start-up lines, before the first call)
        try:
            self._dispatch()
        finally:
            self._shutdown()

    def _dispatch(self) -> None:
        idle = IDLE_POLL_MIN
        while not self.stopping.is_set():
            free = self._slots.take(CLAIM_BATCH, timeout=0.2)
            if not free:
                continue
            if self.stopping.is_set():
                self._slots.give(free)
                break
            self._wake.clear()  # a wake-up from now on means: claim again
            try:
                self._turn += 1  # each partition of a queue is claimed from first in turn
                order = keys.rotated_queues(self.claim_queues, self._turn)
                claimed = self._claims.claim(order, free, self.name, self.lease, self._claim_connection())
            except Exception as e:  # noqa: BLE001 - the dispatcher must go on (a broker hiccup, a bad reply)
                log.warning("claim failed", error=str(e))
                claimed = []
                time.sleep(0.5)
            if claimed and self._claims is not self.core.calls:
                self._confirm_claims([c.call_id for c in claimed])
            if len(claimed) < free:
                self._slots.give(free - len(claimed))
            for c in claimed:
                self.pool.submit(self._run_one, c)
            if len(claimed) == free:
                continue  # there may be more
            # The queues are empty: wait for a wake-up, polling now and then in case one was lost.
            idle = IDLE_POLL_MIN if claimed else min(idle * 2, IDLE_POLL_MAX)
            self._wake.wait(idle)

    def _confirm_claims(self, call_ids: list[str]) -> None:
        """With ``broker.wait_replicas``: wait until the replicas have the claims before the calls start, so a
        primary lost meanwhile cannot hand the same attempt to another worker. Short of that the calls run
        anyway, but one submitted less than ``wait_timeout_ms`` ago is held until its caller has decided
        whether to cancel it (a caller cancels a submission its replicas did not confirm)."""
        confirmer = self.core.confirmer
        if confirmer.wanted():
            try:  # on the claims' own connection (a pipeline would take another from the pool)
                acked: Any = self._claims.conn.execute_command(
                    "WAIT", self.settings.broker.wait_replicas, self.settings.broker.wait_timeout_ms
                )
            except redis.RedisError as e:
                acked = e
            short = confirmer.check(acked, "claims")
            if short is None:
                return
            if time.monotonic() >= self._unconfirmed_logged + 10:
                self._unconfirmed_logged = time.monotonic()
                log.warning("claims not confirmed by the replicas", calls=len(call_ids), why=str(short))
        try:
            self._hold_unconfirmed(call_ids)
        except redis.RedisError as e:
            log.warning("could not check unconfirmed claims for cancels", error=str(e))

    def _hold_unconfirmed(self, call_ids: list[str]) -> None:
        pipe = self.conn.pipeline(transaction=False)
        for cid in call_ids:
            pipe.hget(keys.job(cid), "enqueued_at")
        submitted = [rq_time(v) for v in pipe.execute()]
        limit = self.settings.broker.wait_timeout_ms / 1000 + UNCONFIRMED_MARGIN
        hold = min(max(submitted) + limit - time.time(), limit)
        if hold > 0:
            self.stopping.wait(hold)
        for cid in call_ids:
            pipe.hget(keys.job(cid), keys.F_CANCEL)
        for cid, flag in zip(call_ids, pipe.execute(), strict=True):
            if flag:
                self.core.cancel(cid)  # it ends cancelled without running

    def _shutdown(self) -> None:
        handed_back = drain(self.core, self.pool, self.grace)
        if self._claim_conn is not None:  # (the dispatcher has returned: nobody claims on it any more)
            self.conn.connection_pool.release(self._claim_conn)
            self._claim_conn = None
        try:
            pipe = self.conn.pipeline(transaction=False)  # (keys of several slots on a cluster)
            pipe.zrem(keys.WORKERS, self.name)
            for q in self.queues:
                pipe.zrem(keys.queue_workers(q), self.name)
            pipe.delete(keys.worker(self.name))
            pipe.execute()
            if self.rq is not None:
                self.rq.register_death()
        except redis.RedisError:
            pass
        log.info("worker stopped", worker=self.name, handed_back=handed_back, processed=self.core.processed)

    def refresh_queues(self) -> None:
        """Claim from every partition of the tools on our queues."""
        self.claim_queues[:] = keys.claim_queues(self.queues, (e.spec for e in self.core.directory.all()))

    def _run_one(self, claimed: Any) -> None:
        passed_on = False
        try:
            passed_on = self.runner.run(claimed)
        except Exception:  # noqa: BLE001 - run() never raises; if it did, the token still goes back
            log.exception("call thread failed")
        finally:
            if not passed_on:  # (else its end took the next call: _took gives it or the token)
                self._slots.give()

    def _next_call(self, run: Any) -> Callable[[], list[Any]] | None:
        """TRANSITION's ``take`` for a call ending here: one next call of its queue, on its thread slot, while
        this worker holds less than its share of the key's limit. Its arguments are made when the write goes
        out, so the taken call's lease counts from then."""
        if self.stopping.is_set():
            return None
        queue = run.info.queue
        held = self.core.held(run.info.ckey) - 1  # (the ending call still counts here)
        peers = self._peers.get(keys.base_queue(queue), 1)
        calls, name, lease = self.core.calls, self.name, self.lease
        return lambda: [*calls.claim_args(queue, 1, name, lease), held, peers]

    def _took(self, queue: str, reply: Any, take: Sequence[Any]) -> None:
        """The ending's reply (on the outbox thread): the call it took starts on the ended call's thread slot;
        when it took none the slot goes back. A reply that comes after half the lease starts nothing (no
        heartbeat kept the taken call's lease): the reaper puts that call back at no cost to its attempts."""
        claimed = []
        # (no take: its write never went out; take[2]: the lease deadline the call was taken with)
        answered = bool(take) and not isinstance(reply, Exception) and len(reply) >= 4
        if answered and time.time() > float(take[2]) - self.lease / 2:
            if reply[2]:
                log.warning("a call taken by a late write is left to the reaper", call_id=reply[2][0].decode(errors="replace"))
        elif answered:
            try:
                claimed = self.core.calls.claimed(queue, reply[2], reply[3])
            except Exception as e:  # noqa: BLE001 - (a broker hiccup rechecking an absent id) the slot goes back
                log.warning("taking the next call failed", error=str(e))
        if not claimed:
            self._slots.give()
        for c in claimed:
            try:
                self.pool.submit(self._run_one, c)
            except RuntimeError:  # (shut down meanwhile: leased here, never started; the reaper puts it back)
                log.warning("a call taken at shutdown is left to the reaper", call_id=c.call_id)

    def _heartbeat_once(self) -> None:
        runs = self.core.inflight()
        held = [r.info for r in runs] + [r.info for r in self.core.unwritten()]
        pipe = self.conn.pipeline(transaction=False)
        if self.rq is not None:
            self.rq.heartbeat(pipeline=pipe)
            self.rq.set_state(WorkerStatus.BUSY if runs else WorkerStatus.IDLE, pipeline=pipe)
        now = time.time()
        pipe.zadd(keys.WORKERS, {self.name: now})
        peers: dict[str, int] = {}  # queue -> where its worker count comes in the replies
        for q in self.queues:
            pipe.zadd(keys.queue_workers(q), {self.name: now})
            pipe.zremrangebyscore(keys.queue_workers(q), "-inf", now - self.lease * 2)
            peers[q] = len(pipe)
            pipe.zcard(keys.queue_workers(q))
        pipe.hset(
            keys.worker(self.name),
            mapping={
                "name": self.name,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "queues": ",".join(self.queues),
                "concurrency": self.concurrency,
                "inflight": len(runs),
                "processed": self.core.processed,
                "failed": self.core.failed,
                "policy_version": self.core.policy_version,  # which pushed policy it judges by
                "tool_notices": self.tool_notices,
                "started_at": self.started_at,
                "version": VERSION,
                "heartbeat_interval": self.heartbeat_interval,
                "heartbeat": time.time(),
            },
        )
        pipe.expire(keys.worker(self.name), int(self.lease * 2) + 5)
        self.core.calls.extend_leases(held, self.lease, pipeline=pipe)
        started = time.monotonic()
        # On a cluster, what a moving slot refuses is sent again (within a lease): missed beats would let the
        # reaper take this live worker's calls.
        replies = pipes.settled(pipe, lambda _rounds, _e: time.monotonic() - started < self.lease and not self.stopping.is_set())
        self._peers = {q: max(1, int(replies[i])) for q, i in peers.items()}

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats (a third of the lease, 0.2 to 5 s)."""
        return max(0.2, min(self.lease / 3.0, 5.0))

    def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_interval
        while not self.stopping.is_set():
            self._beat_now.wait(interval)
            if self.stopping.is_set():
                return
            step = "heartbeat"
            try:
                self._heartbeat_once()
                step = "directory"
                self.refresh_queues()
                step = "reaper"
                reaper.reap(self.core.calls, self.claim_queues, self.lease, self.settings.workers.result_ttl, self.core.audit)
                step = "sweep"  # slots still held by calls that ended (a safety net)
                self.core.scheduler.limits.sweep(self.claim_queues, self.lease)
                step = "workers"
                self.conn.zremrangebyscore(keys.WORKERS, "-inf", time.time() - self.lease * 2)
            except redis.RedisError as e:
                log.warning("heartbeat failed", error=str(e), step=step)
            except Exception:  # noqa: BLE001 - the heartbeat must keep going
                log.exception("heartbeat crashed")

    def _control_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                pubsub = subscriber(self.conn)
                wakes = {keys.channel(self.conn, keys.wake(q)).encode() for q in self.queues}
                tools = keys.channel(self.conn, keys.TOOLS_CHANNEL).encode()
                policy = keys.channel(self.conn, keys.POLICY_CHANNEL).encode()
                pubsub.subscribe(keys.channel(self.conn, keys.CONTROL_CHANNEL), tools, policy, *wakes)
                self.core.refresh_policy()  # a push made while we were not subscribed
                while not self.stopping.is_set():
                    msg = pubsub.get_message(timeout=1.0)
                    if msg is None or msg.get("type") != "message":  # (a cluster's pubsub passes confirmations)
                        continue
                    if msg["channel"] in wakes:
                        self._wake.set()  # a call was submitted: claim now instead of at the next poll
                    elif msg["channel"] == tools:
                        self.core.directory.invalidate(msg["data"].decode(errors="replace"))
                        self.refresh_queues()  # a tool's partitions may have changed
                        self.tool_notices += 1
                    elif msg["channel"] == policy:
                        self.core.refresh_policy()
                    else:
                        self._on_control(msg["data"])
                pubsub.close()
            except redis.RedisError as e:
                log.warning("control channel lost", error=str(e))
                time.sleep(1.0)

    def _on_control(self, data: bytes) -> None:
        try:
            msg = unpack(data)
        except Exception:  # noqa: BLE001 - garbage on the channel is ignored
            return
        if not isinstance(msg, dict):
            return
        op = msg.get("op")
        target = msg.get("worker")
        if target and target != self.name:
            return
        if op == "cancel" and msg.get("call_id"):
            self.core.cancel(str(msg["call_id"]))
        elif op == "stop":
            log.info("stop requested over the control channel")
            self.request_stop()
        elif op == "reload":
            self.core.directory.invalidate()
            self.core.reload()


def control_message(op: str, **fields: Any) -> bytes:
    return pack({"op": op, **fields})


_STOP = object()


class CallThreads:
    """Runs ``fn(arg)`` on up to ``size`` threads named ``<prefix>_<n>``: what ``ThreadPoolExecutor`` does
    here, without a ``Future``, a work item and an executor-wide lock per call (``StockThreads`` with the
    ``threads`` shortcut off)."""

    def __init__(self, size: int, prefix: str) -> None:
        self.size = max(1, size)
        self.prefix = prefix
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads that finished a task and will take the next one
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Queue ``fn(arg)``; RuntimeError once shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot run new calls after shutdown")
            self._queue.put((fn, arg))
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < self.size:
                t = threading.Thread(target=self._loop, name=f"{self.prefix}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()

    def _loop(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is _STOP:
                return
            fn, arg = item
            try:
                fn(arg)
            except BaseException:  # noqa: BLE001 - a task's failure must not take the thread with it
                log.exception("call thread task failed")
            with self._lock:
                self._idle += 1

    def shutdown(self, timeout: float | None = None) -> int:
        """Take no more work, drop what has not started and wait for the threads (at most ``timeout``
        seconds: a tool stuck in a call that ignores its cancel must not keep the process; the threads are
        daemons); how many were dropped."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        dropped = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                dropped += 1
        for _ in threads:
            self._queue.put(_STOP)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            log.warning("call threads still in a tool at exit are left behind", threads=stuck)
        return dropped


class StockThreads(CallThreads):
    """The same interface on the standard library's ``ThreadPoolExecutor`` (the ``threads`` shortcut off)."""

    def __init__(self, size: int, prefix: str) -> None:
        super().__init__(size, prefix)
        self._executor = ThreadPoolExecutor(self.size, thread_name_prefix=prefix)
        self._pending: set[Future[None]] = set()

    def submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot run new calls after shutdown")
            future = self._executor.submit(self._run, fn, arg)
            self._pending.add(future)
        future.add_done_callback(self._pending.discard)  # (set.discard is atomic: no lock needed)

    @staticmethod
    def _run(fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except BaseException:  # noqa: BLE001 - as CallThreads: a task's failure is logged, not raised
            log.exception("call thread task failed")

    def shutdown(self, timeout: float | None = None) -> int:
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        dropped = sum(1 for f in pending if f.cancel())
        self._executor.shutdown(wait=timeout is None)
        return dropped


def call_threads(size: int, prefix: str) -> CallThreads:
    """The call threads of a worker: ``CallThreads``, or ``StockThreads`` with the shortcut off."""
    return CallThreads(size, prefix) if shortcut_on("threads") else StockThreads(size, prefix)


class Tokens:
    """A counting semaphore that hands out several tokens at once (the dispatcher claims a batch of calls)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._cv = threading.Condition(threading.Lock())

    @property
    def free(self) -> int:
        return self._n

    def take(self, most: int, timeout: float | None = None) -> int:
        """Up to ``most`` tokens, waiting up to ``timeout`` for the first; 0 when none came."""
        with self._cv:
            if self._n <= 0 and not self._cv.wait_for(lambda: self._n > 0, timeout):
                return 0
            k = min(most, self._n)
            self._n -= k
            return k

    def give(self, k: int = 1) -> None:
        with self._cv:
            self._n += k
            self._cv.notify()
