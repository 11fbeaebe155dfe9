"""Stopping workers: SIGTERM drains within the grace period and hands back the rest; stop over the wire."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from broker import keys
from tests.e2e.util import all_terminal, current, field, histories

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _whole_histories(keep_history: None) -> None:
    """These tests read whole histories of ended calls from Redis (workers.keep_history)."""

GRACE = 1.0
SHORT, LONG = 0.4, 2.0


def test_sigterm_finishes_what_fits_in_the_grace_period_and_hands_back_the_rest(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    home.sleep_tool()
    gateway.sync_tools()
    [first] = workers(1, concurrency=8, grace=GRACE)
    short = [gateway.call_tool("sleep", {"seconds": SHORT}) for _ in range(3)]
    long = [gateway.call_tool("sleep", {"seconds": LONG}) for _ in range(3)]
    ids = [h.call_id for h in short + long]
    wait_until(lambda: set(current(conn, ids).values()) == {"executing"}, 5, message="all calls executing")

    first.terminate()
    assert first.wait(GRACE + 5) == 0
    assert "handed_back=3" in first.log()
    # Nothing was lost: the short calls finished on the first worker, the long ones wait for another.
    assert current(conn, [h.call_id for h in short]) == {h.call_id: "done" for h in short}
    assert current(conn, [h.call_id for h in long]) == {h.call_id: "pending" for h in long}
    assert conn.llen(keys.queue("tools")) == 3
    assert first.name not in {n.decode() for n in conn.zrange(keys.WORKERS, 0, -1)}

    [second] = workers(1, concurrency=8)
    wait_until(lambda: all_terminal(conn, ids), LONG + 5, message="the handed-back calls to finish")
    assert [h.result(timeout=1) for h in short + long] == [{"slept": SHORT}] * 3 + [{"slept": LONG}] * 3

    stored = histories(conn, ids)
    for h in short:
        assert [e.state for e in stored[h.call_id]] == [
            "pending",
            "routing",
            "executing",
            "formatting",
            "done",
        ]
        assert stored[h.call_id][1].detail["worker"] == first.name
    for h in long:
        hist = stored[h.call_id]
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
        assert hist[3].detail["reason"] == "worker_shutdown"
        assert hist[5].detail["worker"] == second.name
        # A hand-back is not the call's fault: it does not use up one of its attempts.
        assert int(field(conn, h.call_id, keys.F_MAX_ATTEMPTS)) == 4


def _cli() -> str:
    path = Path(sys.executable).parent / "hermes-gateway"
    assert path.exists(), f"the hermes-gateway console script is not installed next to {sys.executable}"
    return str(path)


def test_hermes_gateway_stop_all_stops_every_worker_cleanly(
    redis_url: str, home: Any, workers: Any, conn: Any
) -> None:
    started = workers(2, concurrency=2)
    env = {**os.environ, "HERMES_REDIS_URL": redis_url, "HERMES_HOME": str(home.path)}
    out = subprocess.run([_cli(), "stop", "--all"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "stop sent to all workers" in out.stdout
    for w in started:
        assert w.wait(10) == 0
    assert conn.zcard(keys.WORKERS) == 0


def test_a_stop_message_for_one_worker_stops_only_that_one(workers: Any, conn: Any) -> None:
    from workers.worker import control_message

    a, b = workers(2, concurrency=2)
    assert conn.publish(keys.channel(conn, keys.CONTROL_CHANNEL), control_message("stop", worker=a.name)) >= 2
    assert a.wait(10) == 0
    assert b.alive
    assert conn.publish(keys.channel(conn, keys.CONTROL_CHANNEL), control_message("stop")) >= 1
    assert b.wait(10) == 0


def test_a_burst_of_signals_stops_a_busy_logging_worker_without_hanging(
    gateway: Any, home: Any, workers: Any
) -> None:
    # Signals arriving while the worker writes a log line (or while the handler runs) once deadlocked it
    # on the logger's lock: `timeout`, docker and process-group kills send more than one.
    home.echo_tool()
    gateway.sync_tools()
    for _ in range(5):
        [worker] = workers(1, concurrency=8, grace=GRACE)
        handles = [gateway.call_tool("echo", {"i": i}) for i in range(200)]  # "call finished" lines
        for _ in range(200):  # spread out, so some land while the previous one is being handled
            worker.signal(15)
            time.sleep(0.0002)
        # It exits (0, or -15 when a late signal lands while the interpreter is finishing) after a clean stop.
        assert worker.wait(GRACE + 10) in (0, -15), worker.log()
        assert "worker stopped" in worker.log()
        del handles


def test_a_tool_that_ignores_its_cancel_neither_holds_a_stopping_worker_nor_runs_again(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any, tmp_path: Path
) -> None:
    # `stubborn` runs on the call's thread (it takes ctx), sleeps in C and never looks at its cancel. Cancelled, then its worker stopped: the worker exits
    # soon after its grace (it waited on the stuck thread for ever), and the call ends cancelled instead of
    # being handed back (another worker ran it again, to completion).
    home.tool("nap", function="tests.e2e.stoptools:stubborn", timeout=60)
    gateway.sync_tools()
    [first] = workers(1, grace=GRACE)
    marks = tmp_path / "nap"
    h = gateway.call_tool("nap", {"seconds": 12, "path": str(marks)})
    wait_until(lambda: current(conn, [h.call_id])[h.call_id] == "executing", 10, message="the nap to start")
    assert h.cancel() is True
    stopped = time.monotonic()
    first.terminate()
    assert first.wait(GRACE + 8) == 0
    assert time.monotonic() - stopped < GRACE + 6  # (the nap had 11 s to go)
    assert "call threads still in a tool at exit are left behind" in first.log()
    workers(1, grace=GRACE)  # a second worker: nothing is handed to it
    wait_until(lambda: current(conn, [h.call_id])[h.call_id] == "cancelled", 10, message="the call cancelled")
    time.sleep(1.0)  # a negative check, bounded: a handed-back call would start on the new worker at once
    assert Path(f"{marks}.log").read_text().splitlines() == ["start"]


STUBBORN = (  # its first run ignores SIGTERM, forks a child and sleeps; a run after it prints at once
    "import os, signal, sys, time\n"
    "first = not os.path.exists(sys.argv[1])\n"
    "open(sys.argv[1], 'a').write(f'run {os.getpid()}\\n')\n"
    "if first:\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    if os.fork() == 0:\n"
    "        open(sys.argv[1], 'a').write(f'child {os.getpid()}\\n')\n"
    "    time.sleep(60)\n"
    "print('again')\n"
)


def test_a_command_that_ignores_sigterm_dies_with_its_stopping_worker_and_its_handed_back_call_runs_once_more(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any, tmp_path: Path
) -> None:
    """The worker's wait for its call threads (grace + 2 s) ended before the command's kill_grace (2 s) did:
    the command and its child ran on beside the handed-back call's next run."""
    import psutil

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    home.tool("stubborn", executor="command", command=[sys.executable, "-c", STUBBORN, "{{path}}"], timeout=120)
    gateway.sync_tools()
    [first] = workers(1, grace=GRACE)
    log = tmp_path / "runs"
    h = gateway.call_tool("stubborn", {"path": str(log)})
    wait_until(lambda: log.exists() and len(log.read_text().splitlines()) == 2, 10, message="the command and child")
    first.terminate()
    assert first.wait(GRACE + 8) == 0
    assert "handed_back=1" in first.log()
    pids = [int(line.split()[1]) for line in log.read_text().splitlines()]
    wait_until(lambda: not any(running(p) for p in pids), 3, message="the command and its child to die")
    workers(1, grace=GRACE)
    assert h.result(timeout=20) == "again"
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["run", "child", "run"]
