"""A late subscriber on another connection gets a running call's history, then its live tail."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from broker import events
from tests.e2e.util import current

pytestmark = pytest.mark.e2e


def test_a_late_follower_gets_history_then_the_live_tail_once_each(
    gateway: Any, home: Any, workers: Any, redis_url: str, wait_until: Any
) -> None:
    home.sleep_tool()
    gateway.sync_tools()
    workers(1, concurrency=2)
    h = gateway.call_tool("sleep", {"seconds": 0.5})
    other = redis.Redis.from_url(redis_url)
    try:
        wait_until(
            lambda: current(other, [h.call_id])[h.call_id] == "executing", 5, message="the call to run"
        )
        seen = list(events.follow(other, h.call_id, timeout=10))
    finally:
        other.close()
    assert [(e.seq, e.state) for e in seen] == list(
        enumerate(["pending", "routing", "executing", "formatting", "done"], start=1)
    )
    assert seen[-1].detail["result"] == {"slept": 0.5}
    assert h.result(timeout=5) == {"slept": 0.5}
