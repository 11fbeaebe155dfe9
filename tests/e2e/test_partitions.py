"""A tool split in queue partitions on a plain Redis, with real workers (the cluster run is in test_cluster)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.partition_race import race

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _whole_histories(keep_history: None) -> None:
    """These tests read whole histories of ended calls from Redis (workers.keep_history)."""


def test_racing_clients_never_exceed_the_limit_or_queue_size_of_a_partitioned_tool(
    redis_url: str, home: Any, workers: Any, wait_until: Any
) -> None:
    race(redis_url, home, workers, wait_until)
