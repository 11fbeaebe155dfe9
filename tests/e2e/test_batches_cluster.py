"""A small batch on a real 3-primary Redis Cluster, its tool split in 3 partitions (3 slots, 3 shards):
every result written by the calls' TRANSITION in its own slot, each index once, a resubmission runs nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_batches import MARK, _runs
from tests.e2e.test_cluster import cgateway, cluster, curl, cworkers  # noqa: F401  (the cluster fixtures)

pytestmark = pytest.mark.e2e


def test_a_partitioned_batch_on_a_cluster_ends_each_item_once_and_a_resume_runs_nothing_again(
    cgateway: Any, cworkers: Any, home: Any, tmp_path: Path  # noqa: F811
) -> None:
    home.tool("mark", function=MARK, timeout=20, concurrency=6, queue_partitions=3)
    cgateway.sync_tools()
    cworkers(1, concurrency=8)
    marks = tmp_path / "marks"
    items = [{"i": i, "path": str(marks)} for i in range(90)]
    job = cgateway.batch("mark", items, window=30)
    p = job.wait(60)
    assert p.complete and p.counts == {"done": 90}
    results = list(job.results())
    assert sorted(r.index for r in results) == list(range(90))
    assert len({r.call_id.split(".", 1)[0] for r in results}) == 3  # three partitions, three hash tags
    again = cgateway.batch("mark", items, resume=job.id)
    assert again.wait(60).counts == {"done": 90}
    assert sorted(r.index for r in again.results()) == list(range(90))
    runs = _runs(marks)
    assert sorted(runs) == list(range(90)) and set(runs.values()) == {1}


def test_a_batch_submitted_while_its_queues_slot_moves_waits_for_the_slot_and_runs_each_item_once(
    cluster: Any, cgateway: Any, cworkers: Any, home: Any, tmp_path: Path  # noqa: F811
) -> None:
    """The batch submitter sent its chunks with no patience for a moving slot: the first SUBMIT refused
    (TRYAGAIN) stopped the batch ("submission failed: TTL exhausted."), a chunk of it never sent."""
    import time

    from broker import keys

    home.tool("mark", function=MARK, timeout=20, concurrency=8)
    cgateway.sync_tools()
    cworkers(1, concurrency=8)
    marks = tmp_path / "marks"
    assert cgateway.call_tool("mark", {"i": -1, "path": str(tmp_path / "first")}).result(20)  # (the queue's keys)
    slot = cgateway.conn.keyslot(keys.queue("tools"))
    with cluster.slot_moving(slot):  # (a new call's record is not on the source, its queue is: TRYAGAIN)
        job = cgateway.batch("mark", [{"i": i, "path": str(marks)} for i in range(40)])
        time.sleep(1.5)  # three times what redis-py waits on its own
        assert job.error is None, job.error
    p = job.wait(30)
    assert p.complete and p.counts == {"done": 40}
    runs = _runs(marks)
    assert sorted(runs) == list(range(40)) and set(runs.values()) == {1}
