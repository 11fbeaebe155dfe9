"""Every Redis key and channel the gateway uses, laid out for Redis Cluster; at the end, queue partitions.

A call record *is* the RQ job hash (``rq:job:<id>``) with our ``h_*`` fields, on RQ's queue lists, so
``rq info`` sees calls. The keys of a queue and of the calls on it share the queue's hash tag
``{<queue>}`` (a call id starts with it: ``{tools}.<hex>``), so every script about a call or a queue
touches one slot (docs/ARCHITECTURE.md, "Keys and hash slots"); state that spans queues lives in slots of
its own.
"""

from __future__ import annotations

import functools
import itertools
import random
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

RQ_JOB = "rq:job:{}"
RQ_QUEUE = "rq:queue:{}"
RQ_QUEUES = "rq:queues"

PREFIX = "hermes"

# -- per call (the call id carries its queue's tag) --
HISTORY = PREFIX + ":hist:{}"  # list of encoded events of one call, index = seq - 1 (while it runs)
ENDED = PREFIX + ":end:{}"  # string: an ended call's terminal event, kept in place of its history
# -- per queue tag --
LEASES = PREFIX + ":leases:{}"  # zset call_id -> lease deadline (unix seconds), per queue tag
SCHEDULED = PREFIX + ":scheduled:{}"  # zset call_id -> when a ``retrying`` call is due back on ``pending``
LIMITS = PREFIX + ":limits:{}"  # hash concurrency key -> its limit (-1 = none), written by every submission
SLOTS = PREFIX + ":slots:{}:{}"  # zset call_id -> lease deadline (+inf while queued) of calls holding a slot
WAITING = PREFIX + ":waiting:{}:{}"  # zset call_id -> fair tag of interactive calls, per concurrency key
WAITING_BATCH = PREFIX + ":waitb:{}:{}"  # zset call_id -> fair tag of batch calls, per concurrency key
FAIR = PREFIX + ":fair:{}:{}"  # hash: fair dispatch state of a concurrency key's waiting calls (slots.lua)
RATE = PREFIX + ":rate:{}:{}"  # hash: a concurrency key's rate limits, token sum, pause, entries (ratelimit.lua)
RATE_LOG = PREFIX + ":ratelog:{}:{}"  # zset: the rate limiter's sliding log, entry -> when sent (ms)
RATE_DUE = PREFIX + ":ratedue:{}"  # zset concurrency key -> when its rate limiter has room again (ms)
RATES = PREFIX + ":rates:{}"  # set of the concurrency keys with a rate limiter, per queue tag (for status)
IDEMPOTENCY = PREFIX + ":idem:{}:{}"  # idempotency key -> call_id
QUEUE_WORKERS = PREFIX + ":qworkers:{}"  # zset per queue: workers listening on it -> last heartbeat
BATCH_PART = PREFIX + ":batch:{}:{}"  # prefix of a batch's keys on one queue tag: :r results (index ->
#   terminal event), :x results too large for the event (index -> packed result), :o indices in completion
#   order (list), :n counts per terminal state (hash); written by TRANSITION, named in the record's h_batch
# -- channels --
CALLER_CHANNEL = PREFIX + ":ch:{}"  # pub/sub channel of one client (the caller's channel), plain Redis
SHARD_CHANNEL = PREFIX + ":ch:{}:{}"  # the caller's sharded channel of one queue tag, on a cluster
WAKE_CHANNEL = PREFIX + ":wake:{}"  # "a call was queued" nudge to the workers of one queue
CONTROL_CHANNEL = PREFIX + ":ctl"  # cancel / stop / reload broadcasts to every worker
# -- cross-queue state, slots of its own --
BATCH = PREFIX + ":batch:{}"  # hash of one batch's meta: tool, queues, total, state, submitted, created, ttl
BATCHES = PREFIX + ":batches"  # zset batch id -> created (``batch list``)
WORKERS = PREFIX + ":workers"  # zset worker name -> last heartbeat
WORKER = PREFIX + ":worker:{}"  # hash of one worker's figures
FAILURES = PREFIX + ":failures"  # capped list of recent failures
FAILURES_KEPT = 100
TOOLS = PREFIX + ":{dir}:tools"  # hash tool name -> packed directory entry
TOOLS_DIGEST = TOOLS + ":digest"  # hash tool name -> digest of its spec
TOOLS_VER = TOOLS + ":ver"  # hash tool name -> its version
TOOLS_VERSION = TOOLS + ":version"  # counter, bumped on every directory change
TOOLS_CHANNEL = PREFIX + ":tools:changes"  # pub/sub notice of directory changes
AUDIT_STREAM = PREFIX + ":{audit}"  # stream of packed AuditRecords, capped by count and/or age
AUDIT_INDEX = PREFIX + ":{audit}:idx"  # zset call_id -> ms part of its stream id
POLICY = PREFIX + ":policy"  # hash: data (packed Policy), digest, version, pushed_at, source
POLICY_CHANNEL = PREFIX + ":policy:changes"  # pub/sub notice (the new version) of a pushed policy
USAGE_DAY = PREFIX + ":usage:{}:{}"  # hash principal -> tokens used that UTC day (daily_tokens budgets)
STATS = PREFIX + ":stats"  # hash of call figures summed over all workers (workers/telemetry.py)
STATS_INFLIGHT = PREFIX + ":stats:inflight:{}"  # hash concurrency key -> calls running, per worker
STATS_INFLIGHT_BY = PREFIX + ":stats:inflight"  # zset worker -> when it last wrote its in-flight hash
STATS_SEP = "|"  # between the parts of a hermes:stats field (workers/telemetry.py parses them)
STATS_NAMES = PREFIX + ":stats:names:{}"  # set of the values hermes:stats shows of a label (llm, principal)
STATS_CAPPED = frozenset({"llm", "principal"})  # labels whose values a caller picks (a tool name: a manager's)
STATS_MAX_NAMES = 500  # values a label shows; a caller chooses a model or principal: the rest count as STATS_OTHER
STATS_OTHER = "(other)"
BREAKER = PREFIX + ":{{brk}}:breaker:{}"  # hash: state, opened_at, failures, probe, ... of one circuit breaker
BREAKER_WINDOW = PREFIX + ":{{brk}}:breaker:{}:win"  # hash bucket -> calls / failures, for the error-rate rule
BREAKERS = PREFIX + ":{brk}:breakers"  # set of every breaker key (for status)
BREAKER_CHANNEL = PREFIX + ":breakers:changes"  # pub/sub: every breaker state change

# Our fields inside the RQ job hash.
F_STATE = "h_state"
F_SEQ = "h_seq"
F_ATTEMPT = "h_attempt"
F_MAX_ATTEMPTS = "h_max_attempts"
F_CHANNEL = "h_channel"
F_RESULT = "h_result"
F_CANCEL = "h_cancel"
F_WORKER = "h_worker"
F_QUEUE = "h_queue"
F_CKEY = "h_ckey"
F_KIND = "h_kind"
F_TOOL = "h_tool"
F_TRACE = "h_trace"
F_FKEY = "h_fkey"  # the call's fairness key (fair dispatch: whose turn it takes while waiting)
F_CLASS = "h_class"  # interactive | batch
F_SESSION = "h_session"  # the call's session id (absent: none), for the events made without its envelope
F_PRINCIPAL = "h_principal"  # the principal a call runs as (absent: none), read by the API's per-principal checks
F_STEPS = "h_steps"  # one step per transition so far (broker.calls.step_text): an ended call's `steps`, no event decoded
F_BATCH = "h_batch"  # "<ttl> <index> <batch part prefix>" of a batch's call: TRANSITION writes its result there


def stats_ended(kind: str, name: str, state: str, error_type: str | None) -> str:
    """The ``hermes:stats`` field counting calls of ``kind``/``name`` that ended ``state`` (``error_type``):
    the workers' flushes add to it (workers/telemetry.py ``call_ended``), and so do the ends made elsewhere
    (a caller's cancel of a waiting call, the reaper's end of a lost worker's call)."""
    return STATS_SEP.join(("calls", kind, name, state, error_type or ""))

def tag(queue_name: str) -> str:
    """The hash tag of a queue: every key of the queue and of the calls on it carries it."""
    return "{" + queue_name + "}"


def tag_in(name: str) -> str:
    """The hash tag inside a call id or a key (``{tools}`` of ``{tools}.ab12``), '' when it has none."""
    start = name.find("{")
    end = name.find("}", start + 1)
    return name[start : end + 1] if start >= 0 and end > start + 1 else ""


def call_id(queue_name: str, unique: str) -> str:
    """A call id on ``queue_name``: its tag, a dot, then ``unique`` (a caller's own id keeps its tag)."""
    t = tag(queue_name)
    return unique if unique.startswith(t + ".") else f"{t}.{unique}"


def queue_workers(name: str) -> str:
    return QUEUE_WORKERS.format(tag(name))


def queue(name: str) -> str:
    return RQ_QUEUE.format(tag(name))


def queue_name(queue_key: str) -> str:
    """``tools`` of ``rq:queue:{tools}``."""
    return tag_in(queue_key)[1:-1] or queue_key.removeprefix(RQ_QUEUE.format(""))


def channel(conn: Any, base: str) -> str:
    """A pub/sub channel scoped to the connection's database: Redis shares pub/sub across DB numbers, so
    deployments on db 0 and db 1 of one server must not hear each other (a cluster has only db 0)."""
    pool = getattr(conn, "connection_pool", None)
    db = int(pool.connection_kwargs.get("db") or 0) if pool is not None else 0
    return base if db == 0 else f"{base}@db{db}"


def caller_channel(client_id: str, queue_tag: str = "") -> str:
    """The channel a client hears its calls' events on: one per client on a plain Redis; on a cluster one
    per queue tag it uses (a sharded channel in the slot of that queue's calls)."""
    return SHARD_CHANNEL.format(queue_tag, client_id) if queue_tag else CALLER_CHANNEL.format(client_id)


# Keys that fill their pattern as given: the pattern's own ``format`` (no Python frame on the call path).
job: Callable[[str], str] = RQ_JOB.format  # (call_id)
wake: Callable[[str], str] = WAKE_CHANNEL.format  # (queue_name)
history: Callable[[str], str] = HISTORY.format  # (call_id)
ended: Callable[[str], str] = ENDED.format  # (call_id)
leases: Callable[[str], str] = LEASES.format  # (queue_tag)
scheduled: Callable[[str], str] = SCHEDULED.format  # (queue_tag)
limits: Callable[[str], str] = LIMITS.format  # (queue_tag)
waiting: Callable[[str, str], str] = WAITING.format  # (queue_tag, ckey)
waiting_batch: Callable[[str, str], str] = WAITING_BATCH.format  # (queue_tag, ckey)
fair: Callable[[str, str], str] = FAIR.format  # (queue_tag, ckey)
slots: Callable[[str, str], str] = SLOTS.format  # (queue_tag, ckey)
rate: Callable[[str, str], str] = RATE.format  # (queue_tag, ckey)
rate_log: Callable[[str, str], str] = RATE_LOG.format  # (queue_tag, ckey)
rate_due: Callable[[str], str] = RATE_DUE.format  # (queue_tag)
rates: Callable[[str], str] = RATES.format  # (queue_tag)
idempotency: Callable[[str, str], str] = IDEMPOTENCY.format  # (queue_tag, key)
usage_day: Callable[[str, str], str] = USAGE_DAY.format  # (day, principal)
batch: Callable[[str], str] = BATCH.format  # (batch_id)
worker: Callable[[str], str] = WORKER.format  # (name)
breaker: Callable[[str], str] = BREAKER.format  # (key)
stats_inflight: Callable[[str], str] = STATS_INFLIGHT.format  # (worker_name)
stats_names: Callable[[str], str] = STATS_NAMES.format  # (label: tool, llm or principal)


def batch_part(queue_name: str, batch_id: str) -> str:
    """The prefix of a batch's result keys on ``queue_name`` (its tag, so the call's TRANSITION writes them)."""
    return BATCH_PART.format(tag(queue_name), batch_id)


# -- queue partitions ------------------------------------------------------------------------------
# One logical queue spread over N hash tags (``queue_partitions: N`` on a tool): queues ``<queue>#<i>.<k>``,
# where ``k`` is the first suffix that puts partition i's tag in the i-th N-th of the hash slots, so the
# partitions spread evenly over a cluster's shards. The tool's concurrency limit and ``queue_size`` are
# split statically over the partitions (``partition_share``), so each partition's own slot and waiting
# sets bound it exactly; a partition whose limit share is 0 gets no calls. Clients spread calls over the
# partitions in turn (by idempotency key when there is one); workers claim from every partition.

PARTITION_SEP = "#"
# Each process starts its turn at random, or every short-lived client would pick partition 0.
_partition_turn = itertools.count(random.randrange(1 << 30))


def partition_count(spec: Any) -> int:
    """The tool's partition count (``queue_partitions``, default 1)."""
    return max(1, int(spec.config.get("queue_partitions") or 1))


def partition_names(queue: str, n: int) -> list[str]:
    """The queues of a logical queue split in ``n``."""
    return [queue] if n <= 1 else [partition_name(queue, n, i) for i in range(n)]


@functools.lru_cache(maxsize=4096)
def partition_name(queue: str, n: int, i: int) -> str:
    """Partition ``i`` of ``queue`` split in ``n``: ``<queue>#<i>.<k>``, its hash slot in the i-th n-th."""
    lo, hi = i * REDIS_CLUSTER_HASH_SLOTS // n, (i + 1) * REDIS_CLUSTER_HASH_SLOTS // n
    for k in itertools.count():
        candidate = f"{queue}{PARTITION_SEP}{i}.{k}"
        if lo <= key_slot(("{" + candidate + "}").encode()) < hi:
            return candidate
    raise AssertionError("unreachable")


def base_queue(name: str) -> str:
    """The logical queue of a partition (``tools`` of ``tools#3``)."""
    return name.split(PARTITION_SEP, 1)[0]


def partition_index(name: str) -> int:
    """The partition number of a queue name (0 for an unsplit queue)."""
    i = name.partition(PARTITION_SEP)[2].partition(".")[0]
    return int(i) if i.isdigit() else 0


def partition_share(total: int, n: int, i: int) -> int:
    """Partition ``i``'s part of ``total`` split in ``n`` (a negative total, no limit, stays as it is)."""
    if total < 0 or n <= 1:
        return total
    return total // n + (1 if i < total % n else 0)


def partition_route(queue: str, n: int, concurrency: int, idempotency_key: str | None = None, slot: int | None = None) -> str:
    """The partition a new call goes to: the next with a limit share in turn, or by its idempotency key,
    or by ``slot`` (a batch item's index: the same partition whenever the item is submitted again)."""
    if n <= 1:
        return queue
    if slot is None:
        slot = zlib.crc32(idempotency_key.encode()) if idempotency_key else next(_partition_turn)
    usable = n if concurrency < 0 else min(n, concurrency)
    return partition_name(queue, n, slot % usable)


def partition_limits(queue: str, n: int, concurrency: int, queue_size: int) -> tuple[int, int]:
    """(concurrency, queue_size) of the partition ``queue`` of a tool split in ``n`` (queue_size is split
    over the partitions that take calls)."""
    if n <= 1 or PARTITION_SEP not in queue:
        return concurrency, queue_size
    usable = n if concurrency < 0 else min(n, concurrency)
    i = partition_index(queue)
    if i >= usable:
        return 0, min(queue_size, 0)  # (no call is routed here)
    return partition_share(concurrency, n, i), partition_share(queue_size, usable, i)


def claim_queues(queues: Sequence[str], specs: Iterable[Any]) -> list[str]:
    """Every queue a worker of ``queues`` claims from: each logical queue, then its tools' partitions."""
    out = list(queues)
    for spec in specs:
        n = partition_count(spec)
        q = str(spec.config.get("queue") or "tools")
        if n > 1 and q in queues:
            out += [p for p in partition_names(q, n) if p not in out]
    return out


def rotated_queues(queues: Sequence[str], turn: int) -> list[str]:
    """``queues`` in priority order of their logical queues, each one's partitions starting at ``turn``
    (so every partition is drained first in turn)."""
    groups: dict[str, list[str]] = {}
    for q in queues:
        groups.setdefault(base_queue(q), []).append(q)
    out: list[str] = []
    for group in groups.values():
        k = turn % len(group)
        out += group[k:] + group[:k]
    return out
