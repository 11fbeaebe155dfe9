"""Queue partitions: the static split of a tool's limit and queue size, routing, workers' claim order."""

from __future__ import annotations

from typing import Any

from broker import keys
from broker.toolspec import ToolSpec


def spec(n: int, **more: Any) -> ToolSpec:
    return ToolSpec.from_dict(
        {"name": "t", "executor": "python", "function": "m:f", "queue": "q", "queue_partitions": n, **more}
    )


def test_the_shares_of_a_limit_and_a_queue_size_add_up_exactly() -> None:
    for n in (1, 2, 3, 7):
        for limit in (1, 2, 5, 10, 101):
            for qsize in (0, 1, 7, 1000):
                parts = [keys.partition_limits(name, n, limit, qsize) for name in keys.partition_names("q", n)]
                assert sum(c for c, _ in parts) == limit
                usable = min(n, limit)
                assert sum(q for c, q in parts if c > 0) == qsize
                assert all(q == 0 for c, q in parts if c == 0) or usable == n


def test_calls_go_round_the_partitions_with_a_share_and_a_key_always_to_the_same_one() -> None:
    seen = [keys.partition_route("q", 4, 100) for _ in range(40)]
    four = keys.partition_names("q", 4)
    assert {s: seen.count(s) for s in set(seen)} == {p: 10 for p in four}
    assert {keys.partition_route("q", 4, 2) for _ in range(20)} == set(four[:2])  # limit 2: two partitions
    assert len({keys.partition_route("q", 4, 100, "key-1") for _ in range(10)}) == 1
    assert keys.partition_route("q", 1, 100) == "q"


def test_workers_claim_every_partition_of_their_queues_each_first_in_turn() -> None:
    qs = keys.claim_queues(["q", "other"], [spec(3), spec(2, queue="elsewhere")])
    three = keys.partition_names("q", 3)
    assert qs == ["q", "other", *three] and [keys.partition_index(p) for p in three] == [0, 1, 2]
    firsts = {tuple(keys.rotated_queues(qs, t))[0] for t in range(4)}
    assert firsts == {"q", *three}
    assert all(keys.rotated_queues(qs, t).index("other") > keys.rotated_queues(qs, t).index(keys.rotated_queues(qs, t)[0]) for t in range(4))


def test_a_bad_partition_count_is_refused_naming_the_field() -> None:
    import pytest

    from broker.errors import InvalidSpec

    for bad in (0, -1, True, "3", 5000):
        with pytest.raises(InvalidSpec, match="queue_partitions"):
            spec(bad)


def test_partition_tags_fall_in_even_shares_of_the_hash_slots() -> None:
    from redis.crc import key_slot

    for n in (2, 3, 6, 12):
        slots = [key_slot(("{" + p + "}").encode()) for p in keys.partition_names("tools", n)]
        assert [slot * n // 16384 for slot in slots] == list(range(n))  # partition i in the i-th n-th
        assert all(keys.base_queue(p) == "tools" for p in keys.partition_names("tools", n))
