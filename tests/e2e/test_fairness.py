"""Fair dispatch end to end on a plain Redis, with real worker processes and racing submitter processes
(the same scenario runs on a 3-primary cluster in test_cluster.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.e2e


def test_racing_submitters_keep_limit_and_per_key_size_and_a_latecomer_is_served_within_a_round(
    keep_history: None, redis_url: str, home: Any, workers: Any, wait_until: Any
) -> None:
    # (keep_history: each call's whole history is read back to count its runs and spans)
    from tests.e2e.fair_race import fair_race

    fair_race(redis_url, home, workers, wait_until)
