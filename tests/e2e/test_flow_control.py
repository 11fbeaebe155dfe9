"""Flow control on real worker processes: cluster-wide limits, slots of a killed worker, breakers,
retries on a schedule, idempotent resubmission and timeouts that really stop the executor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broker import events, keys
from broker.audit import AuditLog
from broker.codec import unpack
from broker.errors import CallCancelled, CallFailed, CircuitOpen, ExecutorError, ToolTimeout
from tests.conftest import REPO
from tests.e2e.flowtools import lines
from tests.e2e.util import all_terminal, current, field, histories

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _whole_histories(keep_history: None) -> None:
    """These tests read whole histories of ended calls from Redis (workers.keep_history)."""

BACKEND = "tests.e2e.flowtools:backend"
PY = sys.executable


def _intervals(conn: Any, ids: list[str], until: float | None = None) -> list[tuple[float, float]]:
    """[executing, formatting) of every attempt, from the stored events (a lost attempt ends at ``until``)."""
    out = []
    for hist in histories(conn, ids).values():
        start = None
        for e in hist:
            if e.type != events.TRANSITION:
                continue
            if e.state == "executing":
                start = e.ts
            elif start is not None and e.state in ("formatting", "retrying", "failed", "cancelled"):
                out.append((start, e.ts if e.state == "formatting" or until is None else min(e.ts, until)))
                start = None
    return out


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    # Ends sort before starts at the same instant: a slot handed on is not two calls at once.
    marks = sorted(
        [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda m: (m[0], m[1])
    )
    best = now = 0
    for _, d in marks:
        now += d
        best = max(best, now)
    return best


def test_the_limit_holds_across_workers_for_calls_submitted_by_several_processes(
    gateway: Any, home: Any, workers: Any, conn: Any, redis_url: str, wait_until: Any
) -> None:
    home.sleep_tool("slow", concurrency=3, queue_size=100)
    gateway.sync_tools()
    workers(2, concurrency=8)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:  # the slot set itself never holds more than the limit
        while not stop.is_set():
            peak[0] = max(peak[0], conn.zcard(keys.slots("{tools}", "tool:slow")))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = (
        "import json, sys\n"
        "from hermes_gateway.client import Gateway\n"
        "gw = Gateway.connect(sys.argv[1], home=sys.argv[2], embedded_ok=False)\n"
        "batch = gw.map('slow', [{'seconds': 0.15}] * 8)\n"
        "print(json.dumps([h.call_id for h in batch.accepted]))\n"
        "gw.close()\n"
    )
    env = dict(os.environ, HERMES_HOME=str(home.path))
    procs = [
        subprocess.Popen(
            [PY, "-c", code, redis_url, str(home.path)], cwd=REPO, env=env, stdout=subprocess.PIPE
        )
        for _ in range(3)
    ]
    ids = [cid for p in procs for cid in json.loads(p.communicate(timeout=30)[0])]
    assert len(ids) == 24
    wait_until(lambda: all_terminal(conn, ids), 30, message="24 calls done")
    stop.set()
    sampler.join()
    assert set(current(conn, ids).values()) == {"done"}
    assert _max_overlap(_intervals(conn, ids)) == 3  # the limit was reached, and never passed
    assert peak[0] <= 3
    assert conn.zcard(keys.slots("{tools}", "tool:slow")) == 0 and conn.zcard(keys.waiting("{tools}", "tool:slow")) == 0


def _batch_on_two_workers(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any, name: str, *, limit: int, n: int, seconds: float
) -> tuple[list[str], Any]:
    """``n`` sleep calls of a tool with ``limit`` on two workers of 16 threads, all run to ``done`` with never
    more than ``limit`` executing at once; (call ids, the workers)."""
    home.sleep_tool(name, concurrency=limit, queue_size=500)
    gateway.sync_tools()
    pair = workers(2, concurrency=16)
    batch = gateway.map(name, [{"seconds": seconds}] * n)
    ids = [h.call_id for h in batch.accepted]
    assert len(ids) == n
    wait_until(lambda: all_terminal(conn, ids), 60, message=f"{n} calls done")
    assert set(current(conn, ids).values()) == {"done"}
    assert _max_overlap(_intervals(conn, ids)) <= limit
    return ids, pair


def test_the_slots_of_a_busy_key_are_shared_by_the_workers_not_kept_by_the_first(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    # Every ending call hands its slot to the next waiting call on its own worker; whichever worker
    # claimed first at the start would keep all 10 slots for the whole batch without the fair share.
    # (1.5 s of work: a worker process the loaded machine leaves unscheduled for a few hundred ms still
    # gets its share; one kept out of the slots would get next to nothing.)
    ids, _ = _batch_on_two_workers(gateway, home, workers, conn, wait_until, "busy", limit=10, n=300, seconds=0.05)
    ran: dict[str, int] = {}
    for cid in ids:
        name = field(conn, cid, keys.F_WORKER)
        ran[name] = ran.get(name, 0) + 1
    assert len(ran) == 2 and min(ran.values()) >= 60, f"calls per worker: {ran}"


def test_slots_held_by_a_killed_worker_come_back_within_the_lease(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    lease = 1.0
    home.sleep_tool("hold", concurrency=2)
    gateway.sync_tools()
    pair = workers(2, concurrency=8, lease=lease)
    ids = [gateway.call_tool("hold", {"seconds": 1.0}).call_id for _ in range(4)]
    wait_until(lambda: list(current(conn, ids).values()).count("executing") == 2, 10, message="2 executing")
    running = [cid for cid, st in current(conn, ids).items() if st == "executing"]
    victim = next(w for w in pair if w.name == field(conn, running[0], keys.F_WORKER))
    lost = [cid for cid in running if field(conn, cid, keys.F_WORKER) == victim.name]
    assert conn.zcard(keys.waiting("{tools}", "tool:hold")) == 2
    victim.kill()
    killed_at = time.time()

    wait_until(lambda: all_terminal(conn, ids), 15, message="every call done")
    assert set(current(conn, ids).values()) == {"done"}
    stored = histories(conn, ids)
    for cid in lost:
        retrying = next(e for e in stored[cid] if e.state == "retrying")
        assert retrying.detail["reason"] == "worker_lost"
        # The slot went back when the reaper settled the call: within the lease and one heartbeat tick.
        assert retrying.ts - killed_at < lease + lease / 3 + 1.0
    assert _max_overlap(_intervals(conn, ids, until=killed_at)) <= 2
    assert conn.zcard(keys.slots("{tools}", "tool:hold")) == 0


def test_one_worker_starts_waiting_calls_in_the_order_they_were_submitted(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    # Limit 5 on one worker: calls of equal length end in bursts, each freeing a slot for the oldest waiting call.
    home.sleep_tool("ordered", concurrency=5, queue_size=500)
    gateway.sync_tools()
    workers(1, concurrency=8)
    batch = gateway.map("ordered", [{"seconds": 0.04}] * 60)
    ids = [h.call_id for h in batch.accepted]
    wait_until(lambda: all_terminal(conn, ids), 60, message="60 calls done")
    assert set(current(conn, ids).values()) == {"done"}
    stored = histories(conn, ids)
    started = [next(e.ts for e in stored[cid] if e.state == "executing") for cid in ids]
    # Calls that waited (all but the first 5) get their slots in submission order. Their threads then
    # race for the interpreter, so two starting at nearly the same moment may swap by some milliseconds
    # (on a loaded machine, up to ~10); a call handed a slot before an older one would start up to a call's
    # length (40 ms) early.
    late = [
        (i, j)
        for i in range(5, len(ids))
        for j in range(i + 1, len(ids))
        if started[j] < started[i] - 0.02
    ]
    assert late == [], f"started before an older waiting call: {late[:5]}"
    assert _max_overlap(_intervals(conn, ids)) <= 5


def _fragile(home: Any, tmp: Path, **breaker: Any) -> tuple[Path, Path]:
    mode, log = tmp / "mode", tmp / "backend.log"
    mode.write_text("fail")
    home.tool(
        "fragile",
        function=BACKEND,
        timeout=10,
        concurrency=10,
        breaker=breaker,
        input_schema={
            "type": "object",
            "properties": {"tag": {"type": "string"}, "hold": {"type": "number"}},
        },
    )
    return mode, log


def _cooled_down(conn: Any, key: str, cooldown: float) -> bool:
    """The breaker is open and its cooldown is over (by its own ``opened_at``): the next call is the probe."""
    from broker.breaker import Breakers, rejecting

    view = Breakers(conn).state(key)
    return view["state"] == "open" and not rejecting(view, cooldown)


def test_a_breaker_opens_lets_one_probe_through_and_closes_across_two_workers(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path, wait_until: Any
) -> None:
    cooldown = 1.0
    mode, log = _fragile(home, tmp_path, failures=3, cooldown=cooldown)
    gateway.sync_tools()
    # One slot each: the probe holds its worker's slot for 0.8 s, so the other worker must take the refused
    # calls and both workers take part in the half-open round (with 3 slots one worker could take all six).
    a, b = workers(2, concurrency=1)
    changes: list[dict[str, Any]] = []
    pubsub = conn.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.channel(conn, keys.BREAKER_CHANNEL))

    def call(tag: str, hold: float = 0.0) -> Any:
        return gateway.call_tool(
            "fragile", {"mode_file": str(mode), "log": str(log), "tag": tag, "hold": hold}
        )

    # Three failures in a row open it; the third call says so in its own events.
    for i in range(3):
        with pytest.raises(ExecutorError):
            call(f"f{i}").result(10)
    tripped = call("after")
    with pytest.raises(CircuitOpen) as refused:
        tripped.result(10)
    assert refused.value.details["key"] == "tool:fragile"
    assert len(lines(log)) == 3  # the refused call never reached the back end

    # After the cooldown exactly one of six concurrent calls (on both workers) is the probe.
    mode.write_text("ok")
    wait_until(lambda: _cooled_down(conn, "tool:fragile", cooldown), 5, 0.01, "the breaker's cooldown to end")
    batch = [call(f"p{i}", hold=0.8) for i in range(6)]
    outcomes = []
    for h in batch:
        try:
            h.result(10)
            outcomes.append("ok")
        except CircuitOpen:
            outcomes.append("circuit_open")
    assert sorted(outcomes) == ["circuit_open"] * 5 + ["ok"]
    assert len(lines(log)) == 4
    assert {field(conn, h.call_id, keys.F_WORKER) for h in batch} == {a.name, b.name}
    assert call("closed").result(10) == {"ok": True, "tag": "closed"}

    # Open again; a failed probe re-opens it.
    mode.write_text("fail")
    for i in range(3):
        with pytest.raises(ExecutorError):
            call(f"g{i}").result(10)
    wait_until(lambda: _cooled_down(conn, "tool:fragile", cooldown), 5, 0.01, "the breaker's cooldown to end")
    with pytest.raises(ExecutorError):
        call("probe2").result(10)
    with pytest.raises(CircuitOpen):
        call("still-open").result(10)

    def drained() -> bool:
        while (msg := pubsub.get_message(timeout=0.05)) is not None:
            changes.append(unpack(msg["data"]))
        return len(changes) >= 6

    wait_until(drained, 5, message="six breaker changes published")
    pubsub.close()
    assert [(c["previous"], c["state"]) for c in changes] == [
        ("closed", "open"),
        ("open", "half_open"),
        ("half_open", "closed"),
        ("closed", "open"),
        ("open", "half_open"),
        ("half_open", "open"),
    ]
    # The call that tripped it carries the change as a progress event.
    trip_call = changes[0]["call_id"]
    progress = [e for e in events.history(conn, trip_call) if e.type == events.PROGRESS]
    assert progress and progress[0].detail["breaker"]["state"] == "open"


def test_tool_breaker_shows_an_open_breaker_and_reset_lets_the_next_call_through_before_the_cooldown(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    redis_url: str, wait_until: Any,
) -> None:
    from click.testing import CliRunner

    from hermes_gateway.cli import main

    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    mode, log = _fragile(home, tmp_path, failures=2, cooldown=600)
    home.echo_tool()  # no breaker
    gateway.sync_tools()
    workers(1)
    pubsub = conn.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.channel(conn, keys.BREAKER_CHANNEL))
    args = {"mode_file": str(mode), "log": str(log), "tag": "t"}
    for _ in range(2):
        with pytest.raises(ExecutorError):
            gateway.call_tool("fragile", args).result(10)
    with pytest.raises(CircuitOpen):
        gateway.call_tool("fragile", args).result(10)
    runner = CliRunner()
    shown = runner.invoke(main, ["tool", "breaker", "fragile", "--json"])
    assert shown.exit_code == 0, shown.output
    view = json.loads(shown.output)
    assert (view["key"], view["state"], view["last_error"]) == ("tool:fragile", "open", "executor_error")

    mode.write_text("ok")  # the back end is fixed: the operator closes the breaker, 10 minutes early
    reset = runner.invoke(main, ["tool", "breaker", "fragile", "--reset"])
    assert reset.exit_code == 0 and "tool:fragile: reset (was open); closed for fragile" in reset.output, reset.output
    assert gateway.call_tool("fragile", args).result(10) == {"ok": True, "tag": "t"}
    assert len(lines(log)) == 3
    published: list[tuple[str, str]] = []

    def heard_reset() -> bool:  # (serve's console and /metrics hear of it at once)
        while (msg := pubsub.get_message(timeout=0.05)) is not None:
            published.append((unpack(msg["data"])["previous"], unpack(msg["data"])["state"]))
        return ("open", "closed") in published

    wait_until(heard_reset, 5, message="the reset published on the breaker channel")
    pubsub.close()
    again = runner.invoke(main, ["tool", "breaker", "fragile", "--reset", "--json"])  # (a script's form)
    assert json.loads(again.output) == {"key": "tool:fragile", "reset": True, "was": "closed", "tools": ["fragile"]}
    none = runner.invoke(main, ["tool", "breaker", "echo"])
    assert none.exit_code == 1 and "echo has no circuit breaker" in none.output


def _flaky(home: Any, tmp: Path, backoff: float) -> Path:
    """``flaky``: fails the first ``times`` calls (counted in the file returned), retried 3 times at
    ``backoff`` seconds, doubling, no jitter."""
    home.tool(
        "flaky",
        function="tests.e2e.flowtools:fail_times",
        timeout=10,
        retry={"max": 3, "backoff": backoff, "jitter": 0},
        input_schema={"type": "object"},
    )
    return tmp / "count"


def test_a_timeout_the_caller_shortened_does_not_count_against_the_breaker_but_the_specs_does(
    gateway: Any, home: Any, workers: Any, conn: Any
) -> None:
    from broker.breaker import Breakers

    home.sleep_tool("nap", timeout=0.5, breaker={"failures": 2, "cooldown": 60})
    gateway.sync_tools()
    workers(1, concurrency=4)
    # A caller's own short timeouts (here 50 ms against the spec's 0.5 s): its calls fail, the breaker stays
    # closed for everyone else.
    for _ in range(3):
        with pytest.raises(ToolTimeout):
            gateway.call_tool("nap", {"seconds": 1}, timeout=0.05, max_attempts=1).result(10)
    assert Breakers(conn).state("tool:nap")["state"] == "closed"
    assert gateway.call_tool("nap", {"seconds": 0}).result(10) is not None
    # The spec's own timeout is the back end's slowness: two open it.
    for _ in range(2):
        with pytest.raises(ToolTimeout):
            gateway.call_tool("nap", {"seconds": 1}, max_attempts=1).result(10)
    with pytest.raises(CircuitOpen):
        gateway.call_tool("nap", {"seconds": 0}).result(10)


def test_a_failed_call_is_retried_on_schedule_without_holding_a_worker_thread(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path, wait_until: Any
) -> None:
    counter = _flaky(home, tmp_path, backoff=0.4)
    home.echo_tool()
    gateway.sync_tools()
    workers(1, concurrency=1)  # one thread: the other call can only run while the retry waits
    flaky = gateway.call_tool("flaky", {"counter": str(counter), "times": 2}, session_id="s-flaky")
    wait_until(lambda: any(e.state == "executing" for e in events.history(conn, flaky.call_id)), 10,
               message="the flaky call's first attempt")  # fmt: skip
    other = gateway.call_tool("echo", {"x": 1})
    assert flaky.result(15) == {"attempts": 3}
    assert other.result(5) == {"x": 1}
    hist = [e for e in events.history(conn, flaky.call_id) if e.type == events.TRANSITION]
    assert [(e.state, e.attempt) for e in hist] == [
        ("pending", 1),
        ("routing", 1),
        ("executing", 1),
        ("retrying", 1),
        ("pending", 2),
        ("routing", 2),
        ("executing", 2),
        ("retrying", 2),
        ("pending", 3),
        ("routing", 3),
        ("executing", 3),
        ("formatting", 3),
        ("done", 3),
    ]
    # Every event names the call's session, the pending ones a retry's scheduler made included.
    assert {e.session_id for e in hist} == {"s-flaky"} and "" not in {e.span_id for e in hist}
    retrying = [e for e in hist if e.state == "retrying"]
    pendings = [e for e in hist if e.state == "pending"][1:]
    assert [r.detail["delay"] for r in retrying] == [0.4, 0.8]  # exponential, no jitter asked for
    for r, p in zip(retrying, pendings, strict=True):
        assert r.detail["error"]["type"] == "executor_error"
        assert p.ts >= r.detail["next_attempt_at"] - 0.01  # not before it was due
    done_other = [e for e in events.history(conn, other.call_id) if e.state == "done"][0]
    assert done_other.ts < pendings[0].ts  # it ran while the first retry waited

    assert [r.detail["max_attempts"] for r in retrying] == [4, 4]

    # Out of retries: the last error stands; its retrying event named the caller's bound, not the spec's.
    counter.unlink()
    bounded = gateway.call_tool("flaky", {"counter": str(counter), "times": 9}, max_attempts=2)
    with pytest.raises(ExecutorError):
        bounded.result(15)
    assert counter.read_text() == "2"
    retried = [e for e in events.history(conn, bounded.call_id) if e.state == "retrying"]
    assert [(e.detail["next_attempt"], e.detail["max_attempts"]) for e in retried] == [(2, 2)]


def test_a_call_cancelled_while_it_waits_for_its_next_attempt_ends_at_once_and_never_runs_again(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path, wait_until: Any
) -> None:
    counter = _flaky(home, tmp_path, backoff=1.5)
    gateway.sync_tools()
    workers(1)
    h = gateway.call_tool("flaky", {"counter": str(counter), "times": 1})
    wait_until(lambda: gateway.calls.record(h.call_id)["state"] == "retrying", 10, message="its retry to wait")
    asked = time.monotonic()
    assert h.cancel() is True
    with pytest.raises(CallCancelled, match="while it waited for its next attempt"):
        h.result(5)
    assert time.monotonic() - asked < 1.0  # at once, not when the retry was due
    states = [e.state for e in events.history(conn, h.call_id)]
    assert states[-2:] == ["retrying", "cancelled"] or states == ["cancelled"]  # (the kept end alone, trimmed)
    time.sleep(2.0)  # a negative check, bounded: past when the retry was due (its backoff is 1.5 s)
    assert counter.read_text() == "1" and gateway.calls.record(h.call_id)["state"] == "cancelled"
    record = AuditLog(conn).get(h.call_id)  # written by the cancel: no worker held the call
    assert record is not None and record.state == "cancelled" and "while it waited for its next attempt" in (record.error_message or "")


def test_a_call_submitted_twice_with_one_idempotency_key_runs_once(
    gateway: Any, home: Any, workers: Any, redis_url: str, tmp_path: Path
) -> None:
    from hermes_gateway.client import Gateway

    mode, log = _fragile(home, tmp_path)
    mode.write_text("ok")
    gateway.sync_tools()
    workers(1)
    args = {"mode_file": str(mode), "log": str(log), "tag": "charge", "hold": 0.3}
    other = Gateway.connect(redis_url, home=str(home.path), embedded_ok=False)
    try:
        first = gateway.call_tool("fragile", args, idempotency_key="order-42")
        second = other.call_tool("fragile", args, idempotency_key="order-42")
        assert second.call_id == first.call_id
        assert first.result(10) == second.result(10) == {"ok": True, "tag": "charge"}
        again = other.call_tool("fragile", args, idempotency_key="order-42")  # after it finished, too
        assert again.call_id == first.call_id and again.result(5) == {"ok": True, "tag": "charge"}
    finally:
        other.close()
    assert len(lines(log)) == 1


def test_a_timeout_stops_the_command_and_its_process_is_gone(
    gateway: Any, home: Any, workers: Any, tmp_path: Path, wait_until: Any
) -> None:
    script = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    home.tool(
        "napper",
        "command",
        command=[PY, "-c", script, "{{pidfile}}"],
        timeout=30,
        kill_grace=0.5,
        input_schema={"type": "object", "properties": {"pidfile": {"type": "string"}}},
    )
    home.sleep_tool("short", timeout=0.5)
    gateway.sync_tools()
    workers(1)
    pidfile = tmp_path / "pid"
    h = gateway.call_tool("napper", {"pidfile": str(pidfile)}, timeout=1.0)  # per-call timeout
    with pytest.raises(ToolTimeout):
        h.result(10)
    pid = int(wait_until(lambda: pidfile.exists() and pidfile.read_text(), 5, message="pid written"))

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(gone, 5, message=f"process {pid} gone")
    # The tool's own timeout applies when the call gives none.
    with pytest.raises(CallFailed) as info:
        gateway.call_tool("short", {"seconds": 5}).result(10)
    assert info.value.error_type == "tool_timeout"


COUNTING_MIDDLEWARE = '''
import os


def _counted(**kw):
    with open(os.environ["E2E_MIDDLEWARE_LOG"], "a") as f:
        f.write(kw["args"].get("tag", "") + "\\n")
    return kw["next_call"](kw["args"])


def register(ctx):
    ctx.register_middleware("tool_execution", _counted)
'''


def test_an_open_breaker_refuses_before_the_tool_execution_middleware_runs(
    gateway: Any, home: Any, workers: Any, tmp_path: Path
) -> None:
    """DESIGN.md: `executing`: breaker check, then the tool_execution middleware chain around the executor."""
    from middleware import enable_plugin

    root = home.path / "plugins" / "counting"
    root.mkdir(parents=True)
    (root / "plugin.yaml").write_text("name: counting\nversion: '0.1.0'\nkind: standalone\n")
    (root / "__init__.py").write_text(COUNTING_MIDDLEWARE)
    enable_plugin(home.path, "counting")
    mode, log = _fragile(home, tmp_path, failures=2, cooldown=60)
    gateway.sync_tools()
    seen = tmp_path / "middleware.log"
    workers(1, env={"E2E_MIDDLEWARE_LOG": str(seen)})
    call = lambda tag: gateway.call_tool("fragile", {"mode_file": str(mode), "log": str(log), "tag": tag})  # noqa: E731
    for tag in ("f0", "f1"):
        with pytest.raises(ExecutorError):
            call(tag).result(10)
    with pytest.raises(CircuitOpen):
        call("refused").result(10)
    assert seen.read_text().split() == ["f0", "f1"]  # the refused call never reached the middleware


def test_a_back_end_refusing_what_callers_sent_does_not_open_the_breaker_for_everyone(
    gateway: Any, home: Any, workers: Any
) -> None:
    """An HTTP 404/400 answers the caller's arguments (an id that does not exist): one caller asking for missing
    ids must not open the tool's breaker for every caller. The back end's own failures (5xx) still do."""
    from tests.workers.executors.http_server import Recorder

    home.config({"executors": {"http": {"allow_networks": ["127.0.0.1/32"]}}})
    backend = Recorder()
    try:
        gateway.register_tool({
            "name": "item", "executor": "http", "method": "GET", "endpoint": f"{backend.base}/status/{{{{code}}}}",
            "input_schema": {"type": "object", "properties": {"code": {"type": "integer"}}},
            "breaker": {"failures": 2, "cooldown": 60},
        })  # fmt: skip
        workers(1)
        for code in (404, 400, 404):
            with pytest.raises(ExecutorError):
                gateway.call_tool("item", {"code": code}).result(10)
        assert gateway.call_tool("item", {"code": 200}).result(10) is not None
        for _ in range(2):
            with pytest.raises(ExecutorError):
                gateway.call_tool("item", {"code": 503}).result(10)
        with pytest.raises(CircuitOpen):
            gateway.call_tool("item", {"code": 200}).result(10)
        assert len(backend.requests) == 6  # the refused call never reached it
    finally:
        backend.close()
