"""Retries of failed tool calls: the policy (exponential backoff with jitter) and the scheduler.

A failed attempt the tool's ``retry:`` allows goes ``retrying`` with ``next_attempt_at``, gives its
concurrency slot back and waits on the scheduled set (no worker thread held); each worker's scheduler
thread moves due calls back to ``pending``, where they are admitted like new ones.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
import structlog

from broker import pipes
from broker.calls import CallInfo, Calls
from broker.errors import HermesError
from broker.limits import Limits
from broker.otel import new_span_id
from broker.ratelimits import RateLimiter

if TYPE_CHECKING:
    from workers.runner import Running, WorkerCore

log = structlog.get_logger("hermes.retry")

MAX_WAIT = 0.5  # the scheduler looks at least this often (retries scheduled by other processes)


@dataclass(frozen=True)
class RetryPolicy:
    """``retry: {max, backoff, max_backoff, jitter, on}``: ``max`` retries after the first attempt."""

    max: int = 0
    backoff: float = 0.5
    max_backoff: float = 30.0
    jitter: float = 0.2
    factor: float = 2.0
    on: frozenset[str] | None = None  # None: errors marked retryable (executor errors, timeouts)

    @classmethod
    def of(cls, cfg: dict[str, Any] | None) -> RetryPolicy:
        cfg = cfg or {}
        jitter = cfg.get("jitter", 0.2)
        on = cfg.get("on")
        return cls(
            max=int(cfg.get("max", 0)),
            backoff=float(cfg.get("backoff", 0.5)),
            max_backoff=float(cfg.get("max_backoff", 30.0)),
            jitter=(1.0 if jitter else 0.0) if isinstance(jitter, bool) else float(jitter),
            factor=float(cfg.get("factor", 2.0)),
            on=frozenset([on] if isinstance(on, str) else on) if on is not None else None,
        )

    def applies(self, error: HermesError) -> bool:
        """Whether this kind of failure is worth another attempt."""
        if self.on is not None:
            return error.type in self.on
        return bool(getattr(error, "retryable", False))

    def base_delay(self, attempt: int) -> float:
        """The backoff after failed attempt ``attempt`` (1-based), before jitter: exponential, capped."""
        return min(self.max_backoff, self.backoff * self.factor ** max(0, attempt - 1))

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """The wait before the next attempt: within [base * (1 - jitter), base]."""
        return self.base_delay(attempt) * (1.0 - self.jitter * rand())


def plan(core: WorkerCore, run: Running, error: HermesError) -> tuple[float, int] | None:
    """(delay, attempts allowed in all) when the failed attempt should be retried, else None."""
    env = run.env
    if env is None or env.kind != "tool" or run.lost or run.abandoned:
        return None  # LLM calls retry inside their attempt (Retry-After); see workers/llm.py
    try:
        spec = core.directory.get(env.tool or "", env.tool_version).spec
    except HermesError:
        return None
    policy = RetryPolicy.of(spec.retry)
    # The caller's own max_attempts bounds the tool's retries.
    allowed = min(policy.max + 1, env.options.max_attempts or policy.max + 1)
    if run.attempt >= allowed or not policy.applies(error):
        return None
    return policy.delay(run.attempt), allowed


class RetryScheduler:
    """Moves due ``retrying`` calls back to ``pending``; one per worker process, on its own thread."""

    def __init__(self, conn: redis.Redis, hold: float) -> None:
        self.limits = Limits(conn)
        self.limiter = RateLimiter(conn)
        self.calls = Calls(conn)
        self.hold = hold
        self.queues: list[str] = []  # the worker's queues: their due retries are moved here
        self._kick = threading.Event()
        self._next = float("inf")

    def kick(self, due: float) -> None:
        """A retry was scheduled here: look again by ``due``."""
        if due < self._next:
            self._next = due
            self._kick.set()

    def run_once(self) -> tuple[int, float | None]:
        """Move what is due, and promote the calls of rate limiters with room again; returns (moved, next
        due time)."""
        promoted, rate_next = self.limiter.due(self.queues, self.hold, {q: self.calls.wake_channel(q) for q in self.queues})
        due, nxt = self.limits.due(self.queues, self.hold)
        if rate_next is not None:
            nxt = rate_next if nxt is None else min(nxt, rate_next)
        if due:
            pipe = self.calls.conn.pipeline(transaction=False)
            for d in due:
                info = CallInfo(d.call_id, d.trace_id, new_span_id(), d.kind, d.name, d.session_id, d.channel, d.ckey, d.queue)
                self.calls.requeue(info, attempt=d.attempt, pipeline=pipe)
            pipes.execute(pipe, keep_trying=pipes.for_seconds(self.hold))  # (held that long: a moving slot is waited out)
        return len(due) + promoted, nxt

    def run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            try:
                moved, nxt = self.run_once()
            except Exception as e:  # noqa: BLE001 - the scheduler must keep going
                if isinstance(e, redis.RedisError):
                    log.warning("retry scheduler: broker error", error=str(e))
                else:
                    log.exception("retry scheduler crashed")
                stopping.wait(1.0)
                continue
            if moved:
                continue
            self._next = nxt if nxt is not None else float("inf")
            wait = min(MAX_WAIT, max(0.002, self._next - time.time()))
            self._kick.wait(wait)
            self._kick.clear()
