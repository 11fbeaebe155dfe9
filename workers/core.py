"""What a call needs from its worker process: broker access, directory, executors, bookkeeping."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import structlog

from broker import keys, pipes
from broker.audit import AuditLog
from broker.calls import Calls
from broker.config import Settings, load_settings
from broker.directory import Directory
from broker.durability import Confirmer
from broker.envelope import Envelope, concurrency_key
from broker.errors import BudgetExceeded, CallFailed, DecodeError
from broker.ratelimits import RateLimiter
from middleware import LLMCallFlow, PluginManager, ToolCallFlow
from middleware.plugins import NAMESPACE as PLUGIN_NAMESPACE
from workers import metrics, otelsdk, policy_store
from workers.llm import describe_response
from workers.outbox import Outbox
from workers.policy import Policy
from workers.retry import RetryScheduler
from workers.runner import Running

log = structlog.get_logger("hermes.worker")

def _blocked(tool_name: str, message: str, _ctx: dict[str, Any]) -> Any:
    raise CallFailed(
        message or f"tool {tool_name!r} was blocked by a plugin", error_type="blocked", tool=tool_name
    )


class WorkerCore:
    """Shared services of one worker process."""

    def __init__(self, conn: redis.Redis, settings: Settings, name: str) -> None:
        self.conn = conn
        self.settings = settings
        self.name = name
        pipes.configure(settings.broker.fast_path)
        self.calls = Calls(conn)
        self.calls.keep_history = settings.workers.keep_history
        self.confirmer = Confirmer(settings)  # WAITs for the replicas, when broker.wait_replicas asks
        self.outbox = Outbox(conn, confirmer=self.confirmer)
        # Batch calls' writes (``call_class="batch"``) go through an outbox of their own, started with the
        # first: an agent's call never waits behind a batch's round trip (a call's writes all go one way,
        # so their order holds).
        self._batch_outbox: Outbox | None = None
        self.directory = Directory(conn)
        self._inflight: dict[str, Running] = {}
        # Calls that ended here whose writes are still on their way (a cluster slot moving holds them in the
        # outbox): the worker keeps their leases, so the reaper does not take and run them again.
        self._unwritten: dict[str, Running] = {}
        self._writing: dict[int, int] = {}  # writes queued and not answered yet, per run (id of its Running)
        self._held: dict[str, int] = {}  # calls in flight here per concurrency key
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()
        self.processed = 0
        self.failed = 0
        self.idle = threading.Condition(self._lock)
        # config.yaml's policy until one is pushed to Redis (``hermes-gateway policy push``).
        self._config_policy = Policy.from_settings(settings.policy)
        self.policy = self._config_policy
        self.policy_version = 0
        self.refresh_policy()
        self.audit = AuditLog.from_settings(conn, settings.audit)
        self.scheduler = RetryScheduler(conn, hold=settings.workers.lease)  # run on a thread by the Worker
        self.limiter = RateLimiter(conn)
        # Plugins log through stdlib logging (they run inside Hermes too); the root logger is held at
        # WARNING to quiet libraries, so plugin loggers get the gateway's own level.
        logging.getLogger(PLUGIN_NAMESPACE).setLevel(settings.logging.level)
        self.plugins = PluginManager(settings.home, discovery=settings.plugin_discovery)
        self.plugins.load()
        self.tool_flow = ToolCallFlow(self.plugins, on_blocked=_blocked)
        self.llm_flow = LLMCallFlow(self.plugins, describe_response=describe_response)
        # Tracing and metrics from OTEL_* / HERMES_TRACE (off unless asked for); figures for `status --watch`.
        otelsdk.setup("hermes-worker", settings.telemetry)
        metrics.watch_queues(conn)
        self.stats = metrics.StatsFlusher(conn, name, self.inflight_by_key)

    # -- bookkeeping -----------------------------------------------------------------------------

    def ckey_of(self, env: Envelope) -> str:
        return concurrency_key(env)

    def track(self, run: Running) -> None:
        with self._lock:
            self._inflight[run.info.call_id] = run
            ckey = run.info.ckey
            self._held[ckey] = self._held.get(ckey, 0) + 1

    def write(self, run: Running, writer: Callable[[Any], None], callback: Callable[[Any], None]) -> None:
        """Queue a write of ``run`` on the outbox; until it is answered the call counts as ``unwritten``
        once it left this process's in-flight set (its lease is kept)."""
        key = id(run)
        with self._lock:
            self._writing[key] = self._writing.get(key, 0) + 1

        def answered(reply: Any) -> None:
            with self._lock:
                left = self._writing.pop(key, 1) - 1
                if left > 0:
                    self._writing[key] = left
                elif self._unwritten.get(run.info.call_id) is run:
                    del self._unwritten[run.info.call_id]
            callback(reply)

        self.outbox_of(run).put(writer, answered)

    def outbox_of(self, run: Running) -> Outbox:
        """The outbox of ``run``'s writes: the batch one for a batch call (not for an undecodable one)."""
        if run.env is None or run.env.options.call_class != "batch":
            return self.outbox
        if self._batch_outbox is None:  # (the lock only until it exists: every batch write asks)
            with self._lock:
                if self._batch_outbox is None:
                    self._batch_outbox = Outbox(self.conn, confirmer=self.confirmer, name="hermes-outbox-batch")
        return self._batch_outbox

    def flush(self, timeout: float) -> None:
        """Wait until every write queued so far has been sent (both outboxes)."""
        for outbox in (self.outbox, self._batch_outbox):
            if outbox is not None:
                outbox.flush(timeout)

    def unwritten(self) -> list[Running]:
        """Calls no longer running here whose last writes are not in Redis yet (their leases are kept)."""
        with self._lock:
            return list(self._unwritten.values())

    def untrack(self, run: Running) -> None:
        with self._lock:
            if self._inflight.get(run.info.call_id) is run:
                del self._inflight[run.info.call_id]
            if self._writing.get(id(run)):
                self._unwritten[run.info.call_id] = run
            # Paired with track() (runner.run's finally), even when a newer run of the same call id (taken
            # over after a lost lease, then given back to us) replaced this one in _inflight.
            ckey = run.info.ckey
            left = self._held.get(ckey, 1) - 1
            if left > 0:
                self._held[ckey] = left
            else:
                self._held.pop(ckey, None)
            self._cancelled.discard(run.info.call_id)
            self.idle.notify_all()

    def held(self, ckey: str) -> int:
        """Calls of concurrency key ``ckey`` in flight in this process (each holds one of its slots)."""
        return self._held.get(ckey, 0)

    def inflight_by_key(self) -> dict[str, int]:
        """Calls running in this process per concurrency key."""
        out: dict[str, int] = {}
        for run in self.inflight():
            out[run.info.ckey] = out.get(run.info.ckey, 0) + 1
        return out

    def rate_sent(self, run: Running) -> None:
        """The provider answered ``run``'s request (so had received it): stamp its rate limiter entry
        (write-behind: a stamp later than the provider's receipt only keeps the entry counted longer)."""
        info, limiter = run.info, self.limiter
        self.outbox.put(lambda pipe: limiter.sent(info.call_id, info.queue, info.ckey, pipeline=pipe))

    def check_budget(self, principal: str | None) -> None:
        """Raise BudgetExceeded when ``principal`` has used its ``daily_tokens`` today (UTC)."""
        budget = self.policy.daily_tokens(principal) if principal else None
        if budget is None:
            return
        used = int(self.conn.get(keys.usage_day(time.strftime("%Y-%m-%d", time.gmtime()), str(principal))) or 0)
        if used >= budget:
            raise BudgetExceeded(
                f"principal {principal!r} has used {used} of its {budget} tokens today (UTC)",
                principal=principal, used=used, budget=budget,
            )

    def inflight(self) -> list[Running]:
        with self._lock:
            return list(self._inflight.values())

    def inflight_count(self) -> int:
        return len(self._inflight)

    def cancel(self, call_id: str) -> bool:
        """Cancel a call running here (control message); True when it was ours."""
        with self._lock:
            run = self._inflight.get(call_id)
            self._cancelled.add(call_id)
            if len(self._cancelled) > 10_000:  # ids of calls that never came here
                self._cancelled.clear()
            if run is None:
                return False
        if run.ctx is not None:
            run.ctx.cancelled.set()
        return True

    def is_cancelled(self, call_id: str) -> bool:
        # A cancel lands here through the control channel; by the time a call is ``routing`` in
        # Redis it is tracked, so a client that saw ``routing`` and published reaches it.
        return call_id in self._cancelled

    def reload(self) -> None:
        """Re-import plugins and re-read policy (``hermes-gateway plugins reload``)."""
        self.plugins.reload()
        self._config_policy = Policy.from_settings(load_settings(self.settings.home).policy)
        self.refresh_policy()

    def refresh_policy(self) -> bool:
        """Re-read the active policy (a push notice, a reconnect); True when it changed."""
        try:
            policy, version = policy_store.active(self.conn, self._config_policy)
        except DecodeError as e:
            # A broken push must not open everything up: keep judging by the policy we have.
            log.error("stored policy ignored; keeping the current one", error=str(e))
            return False
        changed = policy != self.policy
        self.policy, self.policy_version = policy, version  # the next call reads the new one
        if changed:
            log.info("policy changed", version=version, mode=policy.mode, digest=policy.digest())
        return changed

    def close(self) -> None:
        if self._batch_outbox is not None:
            self._batch_outbox.close()
        self.outbox.close()
        self.stats.close()  # spans still buffered go out in otelsdk.shutdown at exit (bounded)
