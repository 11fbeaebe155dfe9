"""Python tools that ignore ``ctx``: the timeout and cancel end the call at once in a real worker, the
slot is free for the next call, and the function itself is stopped (or cancelled, if async)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from broker.errors import CallCancelled, ToolTimeout
from tests.e2e.util import current, error_type

pytestmark = pytest.mark.e2e

MOD = "tests.e2e.stoptools"


def tool(home: Any, name: str, function: str) -> None:
    home.tool(name, function=f"{MOD}:{function}", timeout=30, concurrency=1)


def notes(path: Path) -> list[str]:
    log = Path(f"{path}.log")
    return log.read_text(encoding="utf-8").split() if log.exists() else []


def test_timeout_ends_a_blocked_sync_call_at_the_deadline_and_frees_its_slot(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path, wait_until: Any
) -> None:
    tool(home, "nap", "nap")
    gateway.sync_tools()
    [w] = workers(1, concurrency=4)
    first = tmp_path / "first"
    start = time.monotonic()
    h = gateway.call_tool("nap", {"seconds": 8, "path": str(first)}, timeout=1)
    with pytest.raises(ToolTimeout):
        h.result(timeout=6)
    took = time.monotonic() - start
    assert 0.9 < took < 2.5, took
    assert error_type(conn, h.call_id) == "tool_timeout"
    assert [e.state for e in h.events(timeout=1) if e.type == "transition"] == ["pending", "routing", "executing", "failed"]
    assert notes(first) == ["start"]  # still asleep in the worker, its call already over

    # Concurrency 1: the next call gets the slot at once, although the first function still sleeps.
    second = tmp_path / "second"
    start = time.monotonic()
    assert gateway.call_tool("nap", {"seconds": 0.1, "path": str(second)}).result(timeout=5) == {"slept": 0.1}
    assert time.monotonic() - start < 1.5
    assert notes(second) == ["start", "after-sleep"]
    assert notes(first) == ["start"]
    assert w.alive


def test_cancel_ends_a_blocked_sync_call_at_once(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path, wait_until: Any
) -> None:
    tool(home, "nap", "nap")
    gateway.sync_tools()
    workers(1, concurrency=4)
    h = gateway.call_tool("nap", {"seconds": 8, "path": str(tmp_path / "c")})
    wait_until(lambda: current(conn, [h.call_id])[h.call_id] == "executing", 5, message="the call to run")
    asked = time.monotonic()
    assert h.cancel() is True
    with pytest.raises(CallCancelled):
        h.result(timeout=5)
    assert time.monotonic() - asked < 1.0
    assert [e.state for e in h.events(timeout=1) if e.type == "transition"] == [
        "pending", "routing", "executing", "cancelled"
    ]
    start = time.monotonic()
    assert gateway.call_tool("nap", {"seconds": 0.1, "path": str(tmp_path / "d")}).result(timeout=5)
    assert time.monotonic() - start < 1.5


def test_a_pure_python_busy_loop_is_stopped_at_the_deadline(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path, wait_until: Any
) -> None:
    tool(home, "spin", "spin")
    gateway.sync_tools()
    workers(1, concurrency=4)
    path = tmp_path / "spin"
    start = time.monotonic()
    h = gateway.call_tool("spin", {"path": str(path), "limit": 20}, timeout=1)
    with pytest.raises(ToolTimeout):
        h.result(timeout=6)
    assert time.monotonic() - start < 2.5
    wait_until(lambda: "ToolStopped" in notes(path), 3, message="the loop to get ToolStopped")
    count = Path(f"{path}.count")
    seen = count.read_text()
    time.sleep(0.5)  # a negative check: a short bounded wait in which a loop that was not stopped would count on
    assert count.read_text() == seen and int(seen) > 0  # it stopped counting
    assert "ran-out" not in notes(path)


def test_an_async_tool_is_cancelled_at_the_deadline(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path, wait_until: Any
) -> None:
    tool(home, "anap", "anap")
    gateway.sync_tools()
    workers(1, concurrency=4)
    path = tmp_path / "anap"
    start = time.monotonic()
    h = gateway.call_tool("anap", {"seconds": 8, "path": str(path)}, timeout=1)
    with pytest.raises(ToolTimeout):
        h.result(timeout=6)
    assert time.monotonic() - start < 2.5
    assert error_type(conn, h.call_id) == "tool_timeout"
    wait_until(lambda: "CancelledError" in notes(path), 3, message="the coroutine to be cancelled")
    assert "finished" not in notes(path)
