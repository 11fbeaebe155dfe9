"""Garbage ids on a queue of a Redis Cluster (issue 31.5): an id of another slot is never looked up (the
claim script would fail after its pops, losing the good calls it popped with it); each is drained with one
warning and the calls behind it run."""

from __future__ import annotations

from typing import Any

import pytest

from broker import keys
from tests.conftest import wait_until
from tests.e2e.test_cluster import cgateway, cluster, curl, cworkers  # noqa: F401 - the cluster's fixtures
from tests.e2e.test_poison_e2e import GARBAGE_IDS

pytestmark = pytest.mark.e2e


def test_garbage_ids_on_a_cluster_queue_are_dropped_with_a_warning_and_lose_no_call(
    cgateway: Any, cworkers: Any, home: Any  # noqa: F811
) -> None:
    home.echo_tool()
    cgateway.sync_tools()
    (worker,) = cworkers(1)
    conn = cgateway.conn
    good = [cgateway.call_tool("echo", {"i": i}) for i in range(3)]
    conn.rpush(keys.queue("tools"), *GARBAGE_IDS)
    after = [cgateway.call_tool("echo", {"i": i}) for i in range(3, 6)]
    assert [h.result(timeout=30) for h in (*good, *after)] == [{"i": i} for i in range(6)]
    wait_until(lambda: conn.llen(keys.queue("tools")) == 0, 10, message="the queue drained")
    wait_until(lambda: worker.log().count("dropped an id on queue") == len(GARBAGE_IDS), 10, message=worker.log())
    assert "non local key" not in worker.log() and "claim failed" not in worker.log()
