"""A worker SIGKILLed mid-call: every accepted call still ends, retried or failed with worker_lost."""

from __future__ import annotations

import time
from typing import Any

import pytest

from broker import keys
from broker.errors import WorkerLost
from tests.e2e.util import all_terminal, current, error_type, field, histories

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _whole_histories(keep_history: None) -> None:
    """These tests read whole histories of ended calls from Redis (workers.keep_history)."""

LEASE = 2.0
SLEEP = 3.0  # long enough that the first worker still runs its four calls once the second one is up


def test_calls_of_a_killed_worker_are_retried_or_fail_with_worker_lost(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    home.sleep_tool()
    gateway.sync_tools()
    # Alternate calls that may be retried with calls that have one attempt only; the first worker takes
    # the first four (both kinds) before the second one starts, so the victim holds calls of both kinds.
    (a,) = workers(1, concurrency=4, lease=LEASE)
    handles = [gateway.call_tool("sleep", {"seconds": SLEEP}, max_attempts=1 + 2 * (i % 2)) for i in range(4)]
    wait_until(lambda: set(current(conn, [h.call_id for h in handles]).values()) == {"executing"}, 5)
    (b,) = workers(1, concurrency=4, lease=LEASE)
    handles += [gateway.call_tool("sleep", {"seconds": SLEEP}, max_attempts=1 + 2 * (i % 2)) for i in range(4)]
    ids = [h.call_id for h in handles]
    once = {h.call_id for i, h in enumerate(handles) if i % 2 == 0}

    wait_until(lambda: set(current(conn, ids).values()) == {"executing"}, 5, message="all 8 calls executing")
    on = {w.name: {cid for cid in ids if field(conn, cid, keys.F_WORKER) == w.name} for w in (a, b)}
    assert on[a.name] | on[b.name] == set(ids)
    # Kill the worker that holds calls of both kinds (each holds four of eight alternating calls).
    victim = next((w for w in (a, b) if on[w.name] & once and on[w.name] - once), None)
    assert victim is not None, f"no worker holds both kinds of call: {on}"
    survivor = b if victim is a else a
    lost = on[victim.name]
    victim.kill()
    killed_at = time.monotonic()

    # Within the lease (+ the reaper's tick, the retry's run and slack) every call has ended.
    wait_until(lambda: all_terminal(conn, ids), LEASE + SLEEP + 5, message="every call terminal")
    assert time.monotonic() - killed_at < LEASE + SLEEP + 5

    stored = histories(conn, ids)
    for cid in ids:
        hist = [e for e in stored[cid] if e.type == "transition"]
        seqs = [e.seq for e in stored[cid]]
        assert seqs == list(range(1, len(seqs) + 1)), cid  # no gap, nothing twice
        if cid not in lost:
            assert [e.state for e in hist] == ["pending", "routing", "executing", "formatting", "done"]
            continue
        if cid in once:
            assert [e.state for e in hist] == ["pending", "routing", "executing", "failed"]
            assert error_type(conn, cid) == "worker_lost"
            assert hist[-1].detail["error"]["type"] == "worker_lost"
        else:
            assert [(e.state, e.attempt) for e in hist] == [
                ("pending", 1),
                ("routing", 1),
                ("executing", 1),
                ("retrying", 1),
                ("pending", 2),
                ("routing", 2),
                ("executing", 2),
                ("formatting", 2),
                ("done", 2),
            ]
            assert hist[3].detail["reason"] == "worker_lost"
            assert hist[5].detail["worker"] == survivor.name
    for h in handles:
        if h.call_id in once and h.call_id in lost:
            with pytest.raises(WorkerLost):
                h.result(timeout=5)
        else:
            assert h.result(timeout=5) == {"slept": SLEEP}
    assert conn.zcard(keys.leases("{tools}")) == 0
    assert survivor.alive


def test_a_killed_workers_command_tools_die_with_it(
    gateway: Any, home: Any, workers: Any, tmp_path: Any
) -> None:
    # An orphaned tool would run on beside its call's retry on another worker, outside the limit.
    import psutil

    marker = f"hermes-orphan-{tmp_path.name}"
    home.tool("long", executor="command", command=["sleep", "30"], timeout=60, env_set={"MARK": marker})
    gateway.sync_tools()
    [worker] = workers(1)
    handle = gateway.call_tool("long", {})

    def tools() -> list[Any]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if p.info["cmdline"] == ["sleep", "30"] and p.environ().get("MARK") == marker:
                    found.append(p)
            except psutil.Error:
                pass
        return found

    deadline = time.monotonic() + 20
    while not tools():
        assert time.monotonic() < deadline, "the tool did not start"
        time.sleep(0.05)
    worker.kill()
    deadline = time.monotonic() + 10
    while tools():
        assert time.monotonic() < deadline, "the tool outlived its killed worker"
        time.sleep(0.05)
    gateway.cancel(handle.call_id)
