"""Cancelling: a waiting call ends at once; a running one stops quickly through its worker."""

from __future__ import annotations

import time
from typing import Any

import pytest

from broker import events
from broker.errors import CallCancelled
from tests.e2e.util import current, error_type

pytestmark = pytest.mark.e2e


def test_cancelling_a_pending_call_cancels_it_at_once_and_no_worker_runs_it(
    gateway: Any, home: Any, workers: Any, conn: Any
) -> None:
    home.sleep_tool()
    gateway.sync_tools()
    h = gateway.call_tool("sleep", {"seconds": 0.1})
    assert h.cancel() is True
    assert current(conn, [h.call_id])[h.call_id] == "cancelled"  # no worker exists yet
    with pytest.raises(CallCancelled):
        h.result(timeout=1)

    workers(1, concurrency=2)
    after = gateway.call_tool("sleep", {"seconds": 0.1})
    assert after.result(timeout=10) == {"slept": 0.1}
    assert [e.state for e in h.events(timeout=1)] == ["pending", "cancelled"]  # (as its caller heard)
    assert [(e.seq, e.state) for e in events.history(conn, h.call_id)] == [(2, "cancelled")]  # the worker skipped it


def test_cancelling_a_running_call_stops_it_quickly(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    home.sleep_tool()
    gateway.sync_tools()
    [w] = workers(1, concurrency=2)
    h = gateway.call_tool("sleep", {"seconds": 30})
    wait_until(lambda: current(conn, [h.call_id])[h.call_id] == "executing", 5, message="the call to run")
    asked = time.monotonic()
    assert h.cancel() is True
    with pytest.raises(CallCancelled):
        h.result(timeout=5)
    assert time.monotonic() - asked < 5
    assert [e.state for e in h.events(timeout=1) if e.type == events.TRANSITION] == [
        "pending", "routing", "executing", "cancelled"
    ]
    assert error_type(conn, h.call_id) == "cancelled"
    assert w.alive
