"""Every Redis key and channel the gateway uses, in one place.

Calls are RQ jobs: the call record *is* the RQ job hash (``rq:job:<id>``) with our own ``h_*`` fields
beside RQ's, and calls wait on RQ's queue lists, so RQ's own tools (``rq info``) see them.
"""

from __future__ import annotations

from typing import Any

RQ_JOB = "rq:job:{}"
RQ_QUEUE = "rq:queue:{}"
RQ_QUEUES = "rq:queues"

PREFIX = "hermes"

HISTORY = PREFIX + ":hist:{}"  # list of encoded events of one call, index = seq - 1
CALLER_CHANNEL = PREFIX + ":ch:{}"  # pub/sub channel of one client (the caller's channel)
CALL_CHANNEL = PREFIX + ":call:{}"  # pub/sub channel for a single call, when the caller asked for one
WAKE_CHANNEL = PREFIX + ":wake:{}"  # "a call was queued" nudge to the workers of one queue
CONTROL_CHANNEL = PREFIX + ":ctl"  # cancel / stop / reload broadcasts to every worker
LEASES = PREFIX + ":leases"  # zset call_id -> lease deadline (unix seconds)
WAITING = PREFIX + ":waiting:{}"  # zset call_id -> submit time, per concurrency key (admission)
IDEMPOTENCY = PREFIX + ":idem:{}"  # idempotency key -> call_id
WORKERS = PREFIX + ":workers"  # zset worker name -> last heartbeat
QUEUE_WORKERS = PREFIX + ":qworkers:{}"  # zset per queue: workers listening on it -> last heartbeat
WORKER = PREFIX + ":worker:{}"  # hash of one worker's figures
FAILURES = PREFIX + ":failures"  # capped list of recent failures
TOOLS = PREFIX + ":tools"  # hash tool name -> packed directory entry
TOOLS_VERSION = PREFIX + ":tools:version"  # counter, bumped on every directory change
TOOLS_CHANNEL = PREFIX + ":tools:changes"  # pub/sub notice of directory changes
AUDIT_STREAM = PREFIX + ":audit"  # stream of packed AuditRecords, capped by count and/or age
AUDIT_INDEX = PREFIX + ":audit:idx"  # zset call_id -> ms part of its stream id
POLICY = PREFIX + ":policy"  # hash: data (packed Policy), digest, version, pushed_at, source
POLICY_CHANNEL = PREFIX + ":policy:changes"  # pub/sub notice (the new version) of a pushed policy
STATS = PREFIX + ":stats"  # hash of call figures summed over all workers (workers/metrics.py)
STATS_INFLIGHT = PREFIX + ":stats:inflight:{}"  # hash concurrency key -> calls running, per worker
SLOTS = PREFIX + ":slots:{}"  # zset call_id -> lease deadline (+inf while queued) of calls holding a slot
LIMITS = PREFIX + ":limits"  # hash concurrency key -> its limit (-1 = none), written by every submission
SCHEDULED = PREFIX + ":scheduled"  # zset call_id -> when a ``retrying`` call is due back on ``pending``
BREAKER = PREFIX + ":breaker:{}"  # hash: state, opened_at, failures, probe, ... of one circuit breaker
BREAKER_WINDOW = PREFIX + ":breaker:{}:win"  # hash bucket -> calls / failures, for the error-rate rule
BREAKERS = PREFIX + ":breakers"  # set of every breaker key (for status)
BREAKER_CHANNEL = PREFIX + ":breakers:changes"  # pub/sub: every breaker state change

# Our fields inside the RQ job hash.
F_STATE = "h_state"
F_SEQ = "h_seq"
F_ATTEMPT = "h_attempt"
F_MAX_ATTEMPTS = "h_max_attempts"
F_CHANNEL = "h_channel"
F_RESULT = "h_result"
F_ERROR = "h_error"
F_CANCEL = "h_cancel"
F_WORKER = "h_worker"
F_QUEUE = "h_queue"
F_CKEY = "h_ckey"
F_KIND = "h_kind"
F_TOOL = "h_tool"
F_TRACE = "h_trace"
F_ENVELOPE = "h_env"


def queue_workers(name: str) -> str:
    return QUEUE_WORKERS.format(name)


def job(call_id: str) -> str:
    return RQ_JOB.format(call_id)


def queue(name: str) -> str:
    return RQ_QUEUE.format(name)


def channel(conn: Any, base: str) -> str:
    """A pub/sub channel scoped to the connection's database: Redis shares pub/sub across DB numbers,
    so two deployments on db 0 and db 1 of one server must not hear each other's control messages."""
    db = int(conn.connection_pool.connection_kwargs.get("db") or 0)
    return base if db == 0 else f"{base}@db{db}"


def wake(queue_name: str) -> str:
    return WAKE_CHANNEL.format(queue_name)


def history(call_id: str) -> str:
    return HISTORY.format(call_id)


def caller_channel(client_id: str) -> str:
    return CALLER_CHANNEL.format(client_id)


def waiting(ckey: str) -> str:
    return WAITING.format(ckey)


def worker(name: str) -> str:
    return WORKER.format(name)


def slots(ckey: str) -> str:
    return SLOTS.format(ckey)


def breaker(key: str) -> str:
    return BREAKER.format(key)


def stats_inflight(worker_name: str) -> str:
    return STATS_INFLIGHT.format(worker_name)
