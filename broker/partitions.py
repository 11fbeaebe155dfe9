"""Queue partitions: one logical queue spread over N hash tags (``queue_partitions: N`` on a tool).

A tool with N > 1 partitions puts its calls on queues ``<queue>#0.<k>`` .. ``<queue>#N-1.<k>``, each its own
hash tag (``{tools#0.3}``...), so on a cluster one hot queue spreads over up to N shards. The suffix ``k``
is the first that puts partition i's tag in the i-th N-th of the 16,384 hash slots — where a cluster made
by ``redis-cli --cluster create`` has its i-th shard when N is a multiple of the shard count — so the
partitions spread evenly instead of falling where their names happen to hash (6 plain names on 3 shards
measured 0.30 / 0.68 / 0.02 of the Redis CPU). The tool's concurrency
limit and ``queue_size`` are split statically over the partitions (``shares``: partition i gets
``total // N`` plus one for the first ``total % N``), so the sums are exactly the tool's figures and each
partition's own slot and waiting sets (exact, atomic, in one slot) bound it: never more than the limit
running, never more than ``queue_size`` waiting, whatever the races. A partition whose limit share is 0
(limit < N) gets no calls. Clients spread calls over the partitions in turn (a call with an idempotency key
always on the same one, where its key lives); workers claim from every partition of their queues,
starting from the next one each round. The price of the static split: a partition may wait for a slot
while another has one free (no borrowing between shards).
"""

from __future__ import annotations

import functools
import itertools
import random
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

SEP = "#"
# Each process starts its turn at random: a client that submits one call and ends (a CLI command, a
# short script) would otherwise always pick partition 0, and a fleet of them use one share of the limit.
_turn = itertools.count(random.randrange(1 << 30))


def count(spec: Any) -> int:
    """The tool's partition count (``queue_partitions``, default 1)."""
    return max(1, int(spec.config.get("queue_partitions") or 1))


def names(queue: str, n: int) -> list[str]:
    """The queues of a logical queue split in ``n``."""
    return [queue] if n <= 1 else [name(queue, n, i) for i in range(n)]


@functools.lru_cache(maxsize=4096)
def name(queue: str, n: int, i: int) -> str:
    """Partition ``i`` of ``queue`` split in ``n``: ``<queue>#<i>.<k>``, its hash slot in the i-th n-th."""
    lo, hi = i * REDIS_CLUSTER_HASH_SLOTS // n, (i + 1) * REDIS_CLUSTER_HASH_SLOTS // n
    for k in itertools.count():
        candidate = f"{queue}{SEP}{i}.{k}"
        if lo <= key_slot(("{" + candidate + "}").encode()) < hi:
            return candidate
    raise AssertionError("unreachable")


def base(name: str) -> str:
    """The logical queue of a partition (``tools`` of ``tools#3``)."""
    return name.split(SEP, 1)[0]


def index(name: str) -> int:
    """The partition number of a queue name (0 for an unsplit queue)."""
    i = name.partition(SEP)[2].partition(".")[0]
    return int(i) if i.isdigit() else 0


def share(total: int, n: int, i: int) -> int:
    """Partition ``i``'s part of ``total`` split in ``n`` (a negative total, no limit, stays as it is)."""
    if total < 0 or n <= 1:
        return total
    return total // n + (1 if i < total % n else 0)


def route(queue: str, n: int, concurrency: int, idempotency_key: str | None = None, slot: int | None = None) -> str:
    """The partition a new call goes to: the next with a limit share in turn, or by its idempotency key,
    or by ``slot`` (a batch item's index: the same partition whenever the item is submitted again)."""
    if n <= 1:
        return queue
    usable = n if concurrency < 0 else min(n, concurrency)
    if slot is not None:
        i = slot % usable
    else:
        i = zlib.crc32(idempotency_key.encode()) % usable if idempotency_key else next(_turn) % usable
    return name(queue, n, i)


def limits(queue: str, n: int, concurrency: int, queue_size: int) -> tuple[int, int]:
    """(concurrency, queue_size) of the partition ``queue`` of a tool split in ``n`` (queue_size is split
    over the partitions that take calls)."""
    if n <= 1 or SEP not in queue:
        return concurrency, queue_size
    usable = n if concurrency < 0 else min(n, concurrency)
    i = index(queue)
    if i >= usable:
        return 0, min(queue_size, 0)  # (no call is routed here)
    return share(concurrency, n, i), share(queue_size, usable, i)


def expand(queues: Sequence[str], specs: Iterable[Any]) -> list[str]:
    """Every queue a worker of ``queues`` claims from: each logical queue, then its tools' partitions."""
    out = list(queues)
    for spec in specs:
        n = count(spec)
        q = str(spec.config.get("queue") or "tools")
        if n > 1 and q in queues:
            out += [p for p in names(q, n) if p not in out]
    return out


def rotated(queues: Sequence[str], turn: int) -> list[str]:
    """``queues`` in priority order of their logical queues, each one's partitions starting at ``turn``
    (so every partition is drained first in turn)."""
    groups: dict[str, list[str]] = {}
    for q in queues:
        groups.setdefault(base(q), []).append(q)
    out: list[str] = []
    for group in groups.values():
        k = turn % len(group)
        out += group[k:] + group[:k]
    return out
