"""A thousand calls through real worker processes: all done, every history complete and ordered."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.e2e.util import histories

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _whole_histories(keep_history: None) -> None:
    """These tests read whole histories of ended calls from Redis (workers.keep_history)."""

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TP = f"00-{TRACE}-{SPAN}-01"
ROAD = ["pending", "routing", "executing", "formatting", "done"]


def test_a_thousand_calls_all_reach_done_with_complete_ordered_histories(
    gateway: Any, home: Any, workers: Any, conn: Any
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    started = workers(2, concurrency=32, lease=5)

    traced = gateway.map("echo", [{"i": i} for i in range(500)], traceparent=TP, session_id="batch-1")
    untraced = gateway.map("echo", [{"i": i} for i in range(500, 1000)])
    handles = traced + untraced
    assert len({h.call_id for h in handles}) == 1000

    assert [h.result(timeout=60) for h in handles] == [{"i": i} for i in range(1000)]

    stored = histories(conn, [h.call_id for h in handles])
    fresh_traces = set()
    for n, h in enumerate(handles):
        hist = stored[h.call_id]
        assert [e.state for e in hist] == ROAD, h.call_id
        assert [e.seq for e in hist] == [1, 2, 3, 4, 5], h.call_id
        assert {e.attempt for e in hist} == {1}
        assert {e.tool_name for e in hist} == {"echo"}
        assert len({e.trace_id for e in hist}) == 1
        assert [e.ts for e in hist] == sorted(e.ts for e in hist)
        # What the caller saw over pub/sub is the same history, nothing missed, nothing twice.
        assert [(e.seq, e.state) for e in h.events(timeout=5)] == [(e.seq, e.state) for e in hist]
        if n < 500:
            assert hist[0].trace_id == TRACE and hist[0].span_id == SPAN
            assert {e.session_id for e in hist} == {"batch-1"}
        else:
            assert re.fullmatch(r"[0-9a-f]{32}", hist[0].trace_id) and set(hist[0].trace_id) != {"0"}
            fresh_traces.add(hist[0].trace_id)
    assert len(fresh_traces) == 500  # a new trace per untraced call, never a shared or empty one
    assert TRACE not in fresh_traces

    workers_seen = {stored[h.call_id][1].detail.get("worker") for h in handles}
    assert workers_seen <= {w.name for w in started}
    assert conn.zcard("hermes:leases") == 0
    assert conn.llen("rq:queue:tools") == 0
    assert all(w.alive for w in started)
