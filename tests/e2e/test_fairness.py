"""Fair dispatch end to end on a plain Redis, with real worker processes and racing submitter processes
(the same scenario runs on a 3-primary cluster in test_cluster.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.e2e


def test_racing_submitters_keep_limit_and_per_key_size_and_a_latecomer_is_served_within_a_round(
    redis_url: str, home: Any, workers: Any, wait_until: Any
) -> None:
    from tests.e2e.fair_race import fair_race

    fair_race(redis_url, home, workers, wait_until)
