"""The core paths on a real 3-primary Redis Cluster (started by ``tests.redis_stack.ClusterStack``), with real workers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from broker import events, keys
from broker.errors import CallCancelled
from tests.conftest import REPO, WorkerFactory, wait_until
from tests.redis_stack import ClusterStack as Cluster

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _whole_histories(keep_history: None) -> None:
    """These tests read whole histories of ended calls from Redis (workers.keep_history)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(3, tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def curl(cluster: Cluster, home: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    for port in cluster.ports:
        cluster.node(port).flushall()
    monkeypatch.setenv("HERMES_REDIS_URL", cluster.url())
    return cluster.url()


@pytest.fixture
def cworkers(curl: str, home: Any, tmp_path: Path) -> Iterator[WorkerFactory]:
    logs = tmp_path / "cluster-worker-logs"
    logs.mkdir()
    factory = WorkerFactory(curl, home, logs)
    yield factory
    factory.stop_all()
    # Nothing a worker wrote was refused by the cluster (a command a cluster pipeline does not take, a
    # script in the wrong slot): every transition went through.
    for w in factory.started:
        bad = [line for line in w.log().splitlines() if "transition not written" in line or "outbox batch failed" in line]
        assert bad == [], bad[:3]


@pytest.fixture
def cgateway(curl: str, home: Any) -> Iterator[Any]:
    from hermes_gateway.client import Gateway

    gw = Gateway.connect(curl, home=str(home.path), embedded_ok=False)
    yield gw
    gw.close()


def _history(gw: Any, cid: str) -> list[Any]:
    return events.history(gw.conn, cid)


def test_each_outbox_write_on_a_cluster_gets_its_own_reply(curl: str) -> None:
    """A worker's outbox sends many calls' writes in one cluster pipeline; each writer's callback gets the
    reply of its own first command. (redis-py's ClusterPipeline queues commands away from its
    ``command_stack``: counted there, every callback got the first write's reply, and one fenced move
    marked every call of its batch lost.)"""
    from broker.connection import from_url
    from workers.outbox import Outbox

    conn = from_url(curl)
    box = Outbox(conn)
    gate, got = threading.Event(), {}
    try:
        box.put(lambda pipe: gate.wait(5) and pipe.exists("hermes:test:gate"))  # (the rest queue up behind it)
        for i in range(12):
            box.put(lambda pipe, i=i: pipe.incrby(f"hermes:test:reply:{i}", i + 1), lambda reply, i=i: got.__setitem__(i, reply))
        gate.set()
        assert box.flush(10)
        assert got == {i: i + 1 for i in range(12)}
    finally:
        box.close()
        conn.close()


def test_status_on_a_cluster_is_a_table_not_a_moved_error(curl: str, cgateway: Any, home: Any) -> None:
    home.sleep_tool()
    cgateway.sync_tools()
    out = subprocess.run(
        [sys.executable, "-m", "hermes_gateway", "status"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert "MovedError" not in out.stdout + out.stderr


def test_an_unreachable_cluster_is_one_line_naming_the_url_with_the_password_masked(monkeypatch: Any, home: Any) -> None:
    from tests.redis_stack import cluster_port as free_port

    url = f"redis+cluster://u:s3cret@127.0.0.1:{free_port()}"
    monkeypatch.setenv("HERMES_REDIS_URL", url)
    out = subprocess.run(
        [sys.executable, "-m", "hermes_gateway", "status"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode != 0
    assert "s3cret" not in out.stdout + out.stderr and "Traceback" not in out.stderr
    assert "redis+cluster://u:***@127.0.0.1" in out.stdout + out.stderr


def test_core_paths_on_a_cluster(cgateway: Any, cworkers: Any, home: Any) -> None:
    gw = cgateway
    home.sleep_tool("nap", concurrency=2, queue_size=50)
    home.sleep_tool("other_nap", queue="other")
    gw.sync_tools()
    cworkers(2, queues="tools,other", concurrency=8)
    # Submit and events: results on two queues (two slots, two sharded channels of this client).
    a = gw.call_tool("nap", {"seconds": 0.05})
    b = gw.call_tool("other_nap", {"seconds": 0.05})
    assert a.result(timeout=20) == {"slept": 0.05} and b.result(timeout=20) == {"slept": 0.05}
    assert a.call_id.startswith("{tools}.") and b.call_id.startswith("{other}.")
    states = [e.state for e in a.events(timeout=5) if e.type == events.TRANSITION]
    assert states[0] == "pending" and states[-1] == "done"
    # Limits: never more than 2 executing; a waiting call cancelled ends at once.
    batch = [gw.call_tool("nap", {"seconds": 0.3}) for _ in range(6)]
    wait_until(lambda: gw.calls.record(batch[0].call_id)["state"] in ("executing", "formatting", "done"), timeout=10, message="the first nap to run")
    last = batch[-1]  # (the limit is 2: it waits for at least 0.6 s more)
    assert gw.cancel(last.call_id) is True
    for h in batch[:-1]:
        assert h.result(timeout=30) == {"slept": 0.3}
    assert gw.calls.record(last.call_id)["state"] == "cancelled"
    spans = []
    for h in batch[:-1]:
        hist = _history(gw, h.call_id)
        start = next(e.ts for e in hist if e.state == "executing")
        end = next(e.ts for e in hist if e.state == "formatting")
        spans.append((start, end))
    marks = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    peak = now = 0
    for _, d in marks:
        now += d
        peak = max(peak, now)
    assert peak <= 2
    # Idempotency: the same key names the same call.
    first = gw.call_tool("nap", {"seconds": 0.01}, idempotency_key="once")
    again = gw.call_tool("nap", {"seconds": 0.01}, idempotency_key="once")
    assert first.call_id == again.call_id and first.result(timeout=20) == {"slept": 0.01}
    # Audit: every finished call has its record.
    from broker.audit import AuditLog

    log = AuditLog(gw.conn)
    assert log.get(a.call_id) is not None and log.get(b.call_id) is not None


def test_a_slot_migration_during_a_batch_loses_no_call_and_runs_none_twice(
    cluster: Cluster, cgateway: Any, cworkers: Any, home: Any
) -> None:
    gw = cgateway
    home.sleep_tool("mig", concurrency=8, queue_size=1000)
    gw.sync_tools()
    cworkers(2, queues="tools", concurrency=8)
    handles = gw.map("mig", [{"seconds": 0.02}] * 200)
    ids = [h.call_id for h in handles.accepted]
    slot = gw.conn.keyslot(keys.queue("tools"))
    dest = next(p for p in cluster.ports if p != cluster.slot_owner(slot))
    wait_until(lambda: gw.calls.record(ids[0])["state"] == "done", timeout=20, message="calls to run before the slot moves")
    moved = cluster.migrate_slot(slot, dest)
    assert moved > 0 and cluster.slot_owner(slot) == dest
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = [gw.calls.record(cid)["state"] for cid in ids]
        if all(s in ("done", "failed", "cancelled") for s in states):
            break
        time.sleep(0.2)
    assert states.count("done") == len(ids), {s: states.count(s) for s in set(states)}
    for cid in ids:
        runs = [e for e in _history(gw, cid) if e.type == events.TRANSITION and e.state == "executing"]
        assert len(runs) == 1, cid


@pytest.mark.parametrize(("batch", "pause"), [(20, 0.05), (5, 0.1)], ids=["fast", "slow"])
def test_a_slot_migration_mid_batch_runs_every_call_exactly_once(
    cluster: Cluster, cgateway: Any, cworkers: Any, home: Any, tmp_path: Path, batch: int, pause: float
) -> None:
    """Issue 31 item 3: while a partition's slot moves (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE), the
    workers' writes meet ASK/TRYAGAIN/MOVED; they must wait it out, keep their leases, and no call may run
    twice — counted from the tool's own side effect (a line per run), not from the results."""
    from collections import Counter

    from broker import keys
    from tests.conftest import wait_until

    gw = cgateway
    runs = tmp_path / "runs.log"
    home.tool(
        "counted",
        function="tests.e2e.flowtools:counted",
        timeout=30,
        concurrency=60,
        queue_size=1000,
        queue_partitions=3,
        input_schema={"type": "object", "properties": {"seconds": {"type": "number"}, "log": {"type": "string"}}},
    )
    gw.sync_tools()
    # A lease shorter than the slow migration: writes that wait for the slot outlast it, so the workers
    # must keep the leases of the calls they finished meanwhile (without that, ~50 of 300 ran twice).
    cworkers(2, queues="tools", concurrency=16, lease=2.0)
    handles = gw.map("counted", [{"seconds": 0.25, "log": str(runs)}] * 300)
    ids = [h.call_id for h in handles.accepted]
    assert len(ids) == 300
    slot = gw.conn.keyslot(keys.queue(keys.partition_name("tools", 3, 1)))
    dest = next(p for p in cluster.ports if p != cluster.slot_owner(slot))
    wait_until(lambda: runs.exists() and len(runs.read_text().splitlines()) >= 20, 30, message="calls running")
    started, moved = time.monotonic(), []
    mover = threading.Thread(target=lambda: moved.append(cluster.migrate_slot(slot, dest, batch=batch, pause=pause)))
    mover.start()
    # More calls submitted while the slot moves (SUBMIT meets TRYAGAIN too): each accepted, none refused.
    wait_until(lambda: cluster.node(dest).execute_command("CLUSTER COUNTKEYSINSLOT", slot) > 0, 10, 0.01)
    late = gw.map("counted", [{"seconds": 0.25, "log": str(runs)}] * 60)
    assert len(late.accepted) == 60
    ids += [h.call_id for h in late.accepted]
    mover.join(60)
    took = time.monotonic() - started
    assert moved[0] > 0 and cluster.slot_owner(slot) == dest

    def ended() -> list[dict[str, Any]] | None:
        records = [gw.calls.record(cid) for cid in ids]
        return records if all(r and r["state"] in ("done", "failed", "cancelled") for r in records) else None

    records = wait_until(ended, 60, 0.2, "every call ended")
    states = Counter(r["state"] for r in records)
    assert states == {"done": 360}, (states, f"migration took {took:.1f}s")
    lines = [line.split() for line in runs.read_text().splitlines()]
    counts = Counter(cid for cid, _ in lines)
    twice = {cid: n for cid, n in counts.items() if n != 1}
    first = [(e.state, e.attempt, e.detail.get("reason")) for e in _history(gw, next(iter(twice)))] if twice else []
    assert set(counts) == set(ids) and twice == {}, (f"{len(twice)} ran more than once", f"{took:.1f}s", first)
    # The one run is the attempt the record reports, within the call's budget.
    ran = {cid: int(attempt) for cid, attempt in lines}
    budget = {cid: int(gw.conn.hget(keys.job(cid), keys.F_MAX_ATTEMPTS)) for cid in ids}
    assert all(r["attempt"] == ran[r["call_id"]] <= budget[r["call_id"]] for r in records)


def test_the_async_client_on_a_cluster_gets_results_and_events_of_two_queues(
    curl: str, cgateway: Any, cworkers: Any, home: Any
) -> None:
    import asyncio

    from hermes_gateway.aio import AsyncGateway

    home.sleep_tool("anap")
    home.sleep_tool("bnap", queue="other")
    cgateway.sync_tools()
    cworkers(1, queues="tools,other", concurrency=8)

    async def run() -> list[Any]:
        async with await AsyncGateway.connect(curl, home=str(home.path), embedded_ok=False) as gw:
            a = await gw.call_tool("anap", {"seconds": 0.05})
            b = await gw.call_tool("bnap", {"seconds": 0.05})
            batch = await gw.map("anap", [{"seconds": 0.01}] * 10)
            out = [await a.result(timeout=20), await b.result(timeout=20)]
            out += [await h.result(timeout=20) for h in batch]
            assert a.call_id.startswith("{tools}.") and b.call_id.startswith("{other}.")
            states = [e.state async for e in a.events(timeout=5) if e.type == events.TRANSITION]
            assert states[0] == "pending" and states[-1] == "done"
            return out

    results = asyncio.run(run())
    assert results[:2] == [{"slept": 0.05}] * 2 and results[2:] == [{"slept": 0.01}] * 10


def test_racing_clients_on_a_cluster_never_exceed_the_limit_or_queue_size_of_a_partitioned_tool(
    curl: str, home: Any, cworkers: Any, wait_until: Any
) -> None:
    from tests.e2e.partition_race import race

    race(curl, home, cworkers, wait_until)


def test_fair_dispatch_on_a_cluster_under_racing_submitters(curl: str, home: Any, cworkers: Any, wait_until: Any) -> None:
    from tests.e2e.fair_race import fair_race

    fair_race(curl, home, cworkers, wait_until)


def test_a_late_follower_on_a_cluster_gets_the_history_then_the_live_tail_each_event_once(
    curl: str, cgateway: Any, cworkers: Any, home: Any
) -> None:
    from broker.connection import from_url

    home.sleep_tool("slow", queue="other")
    cgateway.sync_tools()
    cworkers(1, queues="other", concurrency=4)
    h = cgateway.call_tool("slow", {"seconds": 1.0})
    deadline = time.monotonic() + 10
    while cgateway.calls.record(h.call_id)["state"] != "executing" and time.monotonic() < deadline:
        time.sleep(0.02)
    other = from_url(curl)  # another process's view: only the call id
    try:
        # poll=30, timeout=20: were the live tail not heard on the sharded channel, the events after the
        # history would come only from the re-read at the 20 s timeout (the call takes about 1 s)
        t0 = time.monotonic()
        seen = list(events.follow(other, h.call_id, timeout=20, poll=30))
        assert time.monotonic() - t0 < 15
    finally:
        other.close()
    seqs = [e.seq for e in seen]
    assert seqs == list(range(1, len(seqs) + 1)) and seen[-1].state == "done"
    assert [e.state for e in seen if e.type == events.TRANSITION][:2] == ["pending", "routing"]


def test_stop_name_on_a_cluster_stops_the_worker_which_leaves_the_registry(
    curl: str, cgateway: Any, cworkers: Any
) -> None:
    (w,) = cworkers(1, queues="tools")
    assert cgateway.conn.zscore(keys.WORKERS, w.name) is not None
    out = subprocess.run(
        [sys.executable, "-m", "hermes_gateway", "stop", w.name], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert w.wait(20) == 0
    assert cgateway.conn.zscore(keys.WORKERS, w.name) is None
    assert not cgateway.conn.exists(keys.worker(w.name))


def test_serve_on_a_cluster_takes_a_call_streams_its_events_and_shows_its_record(
    curl: str, cgateway: Any, cworkers: Any, home: Any
) -> None:
    import json
    import os

    import httpx

    from tests.e2e.test_http_api import _serve, _sse
    from tests.e2e.util import free_port, wait_http

    home.sleep_tool()
    cgateway.sync_tools()
    cworkers(1, queues="tools", concurrency=4)
    port = free_port()
    proc = _serve(port, {**os.environ, "HERMES_REDIS_URL": curl, "HERMES_HOME": str(home.path)})
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_http(f"{base}/healthz", proc).status_code == 200
        with httpx.Client(base_url=base, timeout=30) as api:
            waited = api.post("/v1/tools/sleep/calls", json={"args": {"seconds": 0.05}, "wait": 20}).json()
            assert waited["state"] == "done" and waited["result"] == {"slept": 0.05}
            accepted = api.post("/v1/tools/sleep/calls", json={"args": {"seconds": 0.2}})
            assert accepted.status_code == 202
            call = accepted.json()
            streamed = _sse(api, call["events"])
            states = [json.loads(e["data"])["state"] for e in streamed if e["event"] == "transition"]
            assert states == ["pending", "routing", "executing", "formatting", "done"]
            # The 202's link works as given in curl, which takes the `{tools}` of a bare call id for a glob.
            assert "{" not in call["events"] and "}" not in call["events"]
            if shutil.which("curl"):
                out = subprocess.run(["curl", "-sN", base + call["events"]], capture_output=True, text=True, timeout=30)
                assert '"state": "done"' in out.stdout, out.stdout
            got = api.get(f"/v1/calls/{httpx.URL(call['call_id']).raw_path.decode()}").json()
            assert got["state"] == "done" and got["result"] == {"slept": 0.2}
    finally:
        proc.terminate()
        proc.wait(10)


def test_breakers_and_flows_on_a_cluster(curl: str, cgateway: Any, cworkers: Any, home: Any, tmp_path: Path) -> None:
    from broker.errors import CircuitOpen, ExecutorError
    from hermes_gateway.flow import Flow, run_flow
    from tests.e2e.flowtools import lines

    gw = cgateway
    mode, log = tmp_path / "mode", tmp_path / "backend.log"
    mode.write_text("fail")
    home.echo_tool()
    home.tool(
        "fragile", function="tests.e2e.flowtools:backend", timeout=10, concurrency=10,
        breaker={"failures": 3, "cooldown": 30}, input_schema={"type": "object"}, queue="other",
    )
    gw.sync_tools()
    cworkers(1, queues="tools,other", concurrency=4)
    # Three failures open the breaker (its keys in their own slot); the next call is refused unrun.
    for i in range(3):
        with pytest.raises(ExecutorError):
            gw.call_tool("fragile", {"mode_file": str(mode), "log": str(log), "tag": f"f{i}"}).result(20)
    with pytest.raises(CircuitOpen):
        gw.call_tool("fragile", {"mode_file": str(mode), "log": str(log), "tag": "after"}).result(20)
    assert len(lines(log)) == 3
    from broker.breaker import Breakers

    assert Breakers(gw.conn).all()[0]["state"] == "open"
    # A flow: steps are ordinary calls, results passed by reference.
    flow = (
        Flow("trip")
        .step("lookup", "echo", {"city": "{{ args.city }}"})
        .step("again", "echo", {"twice": "{{ steps.lookup.result.city }}"})
    )
    out = run_flow(gw, flow, {"city": "Paris"})
    assert out.state == "done", out.error
    assert out.steps["again"].result == {"twice": "Paris"}


def test_a_pushed_policy_and_a_removed_tool_reach_the_workers_on_a_cluster(
    curl: str, cgateway: Any, cworkers: Any, home: Any
) -> None:
    from broker.errors import HermesError, UnknownTool
    from workers import policy_store
    from workers.policy import Policy

    gw = cgateway
    home.echo_tool("guarded")  # declares no permissions: open under permissive, refused under strict
    gw.sync_tools()
    cworkers(1, queues="tools")
    def allowed() -> bool:
        try:
            return bool(gw.call_tool("guarded", {"x": 2}).result(20) == {"x": 2})
        except HermesError as e:
            assert e.type == "permission_denied"
            return False

    assert allowed()  # config.yaml's policy (permissive)
    policy_store.push(gw.conn, Policy.from_dict({"mode": "strict"}))
    deadline = time.monotonic() + 10
    while allowed():  # the workers apply the pushed policy on its notice
        assert time.monotonic() < deadline, "the pushed policy did not reach the worker"
        time.sleep(0.1)
    policy_store.clear(gw.conn)
    assert gw.directory.remove("guarded") is True
    with pytest.raises(UnknownTool):
        gw.call_tool("guarded", {"x": 3})


def test_a_plain_url_naming_one_node_is_taken_as_the_clusters_seed(
    cluster: Cluster, curl: str, home: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's first try: ``HERMES_REDIS_URL=redis://<a node>`` gave a raw MovedError traceback."""
    from broker.connection import from_url, is_cluster
    from broker.errors import BrokerUnavailable
    from hermes_gateway.client import Gateway

    node = f"redis://127.0.0.1:{cluster.ports[0]}"
    monkeypatch.setenv("HERMES_REDIS_URL", node)
    home.sleep_tool()
    for cmd in (["tool", "register", str(home.tools_dir / "sleep.yaml")], ["tool", "list"], ["status"]):
        out = subprocess.run(
            [sys.executable, "-m", "hermes_gateway", *cmd], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert out.returncode == 0, (cmd, out.stderr)
        assert "Traceback" not in out.stderr and "MovedError" not in out.stdout + out.stderr
        if cmd[:2] == ["tool", "list"]:
            assert "sleep" in out.stdout
    conn = from_url(node)
    assert is_cluster(conn)
    conn.close()
    logs = tmp_path / "plain-url-worker-logs"
    logs.mkdir()
    started = WorkerFactory(node, home, logs)
    try:
        started(1)
        gw = Gateway.connect(node, home=str(home.path), embedded_ok=False)
        try:
            assert gw.call_tool("sleep", {"seconds": 0.01}).result(timeout=20) == {"slept": 0.01}
        finally:
            gw.close()
    finally:
        started.stop_all()
    # A cluster has database 0 only: a URL naming another is refused, saying so.
    with pytest.raises(BrokerUnavailable, match="only database 0: drop /9 from the URL"):
        from_url(node + "/9")


def test_wait_replicas_on_a_cluster_is_refused_plainly_by_the_client_and_the_worker(
    curl: str, home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.errors import ConfigError
    from hermes_gateway.client import Gateway

    monkeypatch.setenv("HERMES_WAIT_REPLICAS", "1")
    with pytest.raises(ConfigError, match="not supported on a Redis Cluster"):
        Gateway.connect(curl, home=str(home.path), embedded_ok=False)
    out = subprocess.run(
        [sys.executable, "-m", "workers", "--queues", "tools"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode != 0
    assert "not supported on a Redis Cluster" in out.stderr and "Traceback" not in out.stderr


def test_mcp_serve_over_stdio_on_a_cluster_lists_and_calls_a_tool(curl: str, cgateway: Any, cworkers: Any, home: Any) -> None:
    import asyncio
    import os

    from workers.executors.mcp_session import client_for as _client

    home.echo_tool("lookup", description="Look a thing up")
    cgateway.sync_tools()
    cworkers(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env.update(HERMES_REDIS_URL=curl, HERMES_HOME=str(home.path))
    server = {"command": [str(Path(sys.executable).parent / "hermes-gateway"), "mcp", "serve"], "env": env,
              "stderr": "discard"}

    async def session() -> tuple[Any, Any]:
        async with _client(server, 1 << 24, lambda: None) as client:
            return await client.list_tools(), await client.call_tool("lookup", {"city": "北京"})

    listed, found = asyncio.run(session())
    assert "lookup" in {t.name for t in listed.tools}
    assert not found.is_error and found.structured_content == {"city": "北京"}


def test_one_call_clients_spread_over_partitions_and_status_shows_the_tools_whole_limit(
    curl: str, home: Any
) -> None:
    """Trying it as a new user: every ``tool run`` (one call per process) landed on partition 0, so a fleet
    of such clients had a third of the limit; ``status`` showed a partition's share (2) as the limit (6)."""
    import json

    from hermes_gateway.client import Gateway

    home.sleep_tool("wide", concurrency=6, queue_partitions=3)
    gw = Gateway.connect(curl, home=str(home.path), embedded_ok=False, check_workers=False)
    try:
        gw.sync_tools()
        for _ in range(3):  # one client in turn: one call on each partition (no worker: they wait)
            gw.call_tool("wide", {"seconds": 0.01})
    finally:
        gw.close()
    out = subprocess.run(
        [sys.executable, "-m", "hermes_gateway", "status", "--json"], capture_output=True, text=True, timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    row = next(r for r in json.loads(out.stdout)["concurrency"] if r["key"] == "tool:wide")
    assert row["limit"] == 6 and row["running"] + row["waiting"] <= 3
    one_call = (
        "from hermes_gateway.client import Gateway\n"
        "gw = Gateway.connect(embedded_ok=False, check_workers=False)\n"
        "print(gw.call_tool('wide', {'seconds': 0.01}).call_id)\n"
        "gw.close()\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", one_call], stdout=subprocess.PIPE, text=True, cwd=REPO)
        for _ in range(10)
    ]
    tags = set()
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        tags.add(stdout.strip().split("}", 1)[0])
    # Ten one-call clients all on one of three partitions: 3 * (1/3)^10, once in 20,000 runs.
    assert len(tags) > 1, tags


def test_the_consoles_scheduled_retries_count_the_retries_of_every_queue(curl: str, cworkers: Any, home: Any,
                                                                       tmp_path: Path) -> None:
    """The console's stats read ``hermes:scheduled:{}`` (the key's template): always 0."""
    from hermes_gateway import console_data
    from hermes_gateway.client import Gateway

    home.tool(
        "flaky",
        function="tests.e2e.flowtools:fail_times",
        timeout=10,
        retry={"max": 3, "backoff": 30, "jitter": 0},
        input_schema={"type": "object"},
    )
    cworkers(1)
    gw = Gateway.connect(curl, home=str(home.path), embedded_ok=False)
    try:
        gw.sync_tools()
        h = gw.call_tool("flaky", {"counter": str(tmp_path / "count"), "times": 1})
        deadline = time.monotonic() + 20
        while gw.calls.record(h.call_id)["state"] != "retrying":
            assert time.monotonic() < deadline, "the call never got to retrying"
            time.sleep(0.05)
        assert console_data.snapshot(gw)["scheduled_retries"] == 1
        assert gw.cancel(h.call_id) is True
    finally:
        gw.close()


def test_a_cluster_url_naming_a_database_or_options_is_refused_in_one_line(cluster: Cluster, curl: str) -> None:
    """``redis+cluster://node/3`` ran on database 0 and ``?ssl=true`` was dropped, both silently."""
    seed = f"redis+cluster://u:s3cret@127.0.0.1:{cluster.ports[0]}"
    for url, said in ((seed + "/3", "only database 0: drop /3"), (seed + "?ssl=true", "takes no ?options")):
        out = subprocess.run(
            [sys.executable, "-m", "hermes_gateway", "status"], capture_output=True, text=True, timeout=60,
            cwd=REPO, env={**os.environ, "HERMES_REDIS_URL": url},
        )
        assert out.returncode != 0 and said in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "s3cret" not in out.stdout + out.stderr


def test_an_outbox_write_a_moving_slot_refuses_holds_back_only_its_own_callback(curl: str, cluster: Cluster) -> None:
    """While a slot migrates, a script on two of its keys, one moved and one not, is refused (TRYAGAIN) and
    the outbox sends it again until the slot settles; the other writes of its pipeline ran, and their
    callbacks (a call's take, a caller's hand-off) are answered at once instead of waiting for it."""
    from broker import pipes
    from broker.connection import from_url
    from workers.outbox import Outbox

    conn = from_url(curl)
    here, absent = "{hermes:test:mv}:here", "{hermes:test:mv}:absent"
    conn.set(here, "1")
    slot = conn.keyslot(here)
    src = cluster.slot_owner(slot)
    dst = next(p for p in cluster.ports if p != src)
    assert conn.keyslot("hermes:test:elsewhere") != slot
    script = conn.register_script("redis.call('GET', KEYS[1]); return redis.call('INCR', KEYS[2])")
    script(keys=[here, absent], args=[])  # (loaded on its node; the INCR makes `absent` 1)
    conn.delete(absent)
    cluster.node(dst).execute_command("CLUSTER SETSLOT", slot, "IMPORTING", cluster.node_id(src))
    cluster.node(src).execute_command("CLUSTER SETSLOT", slot, "MIGRATING", cluster.node_id(dst))
    box = Outbox(conn)
    gate, got = threading.Event(), {}
    refusals: list[int] = []  # each time the moving slot refused the write and the outbox was asked to send it again
    keep_trying = box._keep_trying

    def counted(rounds: int, error: Exception) -> bool:
        refusals.append(rounds)
        return keep_trying(rounds, error)

    box._keep_trying = counted  # type: ignore[method-assign]
    try:
        try:
            box.put(lambda pipe: gate.wait(5) and pipe.exists("hermes:test:gate"))  # (the rest queue up behind it)
            box.put(lambda pipe: pipes.script(script, [here, absent], [], pipe), lambda reply: got.__setitem__("moving", reply))
            box.put(lambda pipe: pipe.incr("hermes:test:elsewhere"), lambda reply: got.__setitem__("other", reply))
            gate.set()
            wait_until(lambda: "other" in got, timeout=5, message="the write that ran to be answered")
            assert got["other"] == 1
            wait_until(lambda: len(refusals) >= 4, timeout=5, message="a few resends of the refused write")
            assert "moving" not in got  # refused each time: it is still held back
        finally:
            for port in (src, dst):  # the move called off: the slot is its source's again
                cluster.node(port).execute_command("CLUSTER SETSLOT", slot, "STABLE")
        wait_until(lambda: "moving" in got, timeout=15, message="the refused write to go through")
        assert got["moving"] == 1
    finally:
        box.close()
        conn.close()


def test_an_http_call_submitted_while_its_queues_slot_moves_waits_for_the_slot_instead_of_a_503(
    cluster: Cluster, cgateway: Any, cworkers: Any, home: Any
) -> None:
    """The HTTP API submits on the asyncio client, which sent a SUBMIT refused by a moving slot (TRYAGAIN) on
    to redis-py alone: it gave up within half a second, a 503 "TTL exhausted", where the sync client waits
    the move out (``pipes.SUBMIT_PATIENCE``)."""
    import httpx

    from tests.e2e.test_http_api import Served

    home.sleep_tool()
    cgateway.sync_tools()
    cworkers(1, queues="tools", concurrency=4)
    assert cgateway.call_tool("sleep", {"seconds": 0.01}).result(timeout=20) == {"slept": 0.01}  # (the queue's keys)
    slot = cgateway.conn.keyslot(keys.queue("tools"))
    served, pool = Served(cgateway), ThreadPoolExecutor(1)
    try:
        with httpx.Client(base_url=served.base, timeout=30) as api:
            # (a new call's record is not on the source yet, its queue is: TRYAGAIN until the slot settles)
            with cluster.slot_moving(slot):
                posted = pool.submit(api.post, "/v1/tools/sleep/calls", json={"args": {"seconds": 0.01}, "wait": 20})
                time.sleep(1.5)  # three times what redis-py waits on its own
                assert not posted.done(), posted.result().text
            reply = posted.result(30)
            assert reply.status_code == 200, reply.text
            assert reply.json()["state"] == "done" and reply.json()["result"] == {"slept": 0.01}
    finally:
        pool.shutdown()
        served.stop()


def test_a_primary_killed_mid_batch_is_replaced_by_its_replica_and_every_accepted_call_ends(
    home: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster node failover (docs/reliability.md): the primary of the queue's slot killed (-9) while
    calls run, its replica promoted; every call ends done, each ran (counted from the tool's side), a
    rerun is reported as a later attempt, and calls submitted after the promotion go through."""
    from collections import Counter

    from hermes_gateway.client import Gateway

    with Cluster(3, tmp_path / "cluster", replicas=1) as cl:
        monkeypatch.setenv("HERMES_REDIS_URL", cl.url())
        runs = tmp_path / "runs.log"
        home.tool("counted", function="tests.e2e.flowtools:counted", timeout=30, concurrency=60, queue_size=1000,
                  input_schema={"type": "object"})
        logs = tmp_path / "logs"
        logs.mkdir()
        workers = WorkerFactory(cl.url(), home, logs)
        gw = Gateway.connect(cl.url(), home=str(home.path), embedded_ok=False)
        try:
            gw.sync_tools()
            workers(2, concurrency=16, lease=2.0)
            ids = [h.call_id for h in gw.map("counted", [{"seconds": 0.25, "log": str(runs)}] * 200).accepted]
            assert len(ids) == 200
            slot = gw.conn.keyslot(keys.queue("tools"))
            old = cl.slot_owner(slot)
            wait_until(lambda: runs.exists() and len(runs.read_text().splitlines()) >= 30, 30, message="calls running")
            next(n for n in cl.nodes if n.port == old).kill()
            wait_until(lambda: cl.slot_owner(slot) != old, 30, 0.1, "the replica to be promoted")
            late = gw.map("counted", [{"seconds": 0.25, "log": str(runs)}] * 20)
            assert len(late.accepted) == 20
            ids += [h.call_id for h in late.accepted]

            def ended() -> list[dict[str, Any]] | None:
                records = [gw.calls.record(cid) for cid in ids]
                return records if all(r and r["state"] in ("done", "failed", "cancelled") for r in records) else None

            records = wait_until(ended, 60, 0.2, "every call ended")
            assert Counter(r["state"] for r in records) == {"done": 220}
            counts = Counter(line.split()[0] for line in runs.read_text().splitlines())
            assert set(counts) == set(ids)
            attempts = {r["call_id"]: r["attempt"] for r in records}
            assert all(attempts[cid] > 1 for cid, n in counts.items() if n > 1), counts
        finally:
            gw.close()
            workers.stop_all()


def test_waiting_calls_cancelled_while_their_queues_slot_moves_are_cancelled_once_it_settles_not_refused(
    cluster: Cluster, cgateway: Any, cworkers: Any, home: Any
) -> None:
    """Cancelling a waiting call runs a script on its queue's slot: while the slot moved, it was refused
    (TRYAGAIN) and both clients gave up within half a second ("TTL exhausted": ``gw.cancel`` raised it, the
    HTTP cancel route answered 503). It is sent again as a submission is (``pipes.SUBMIT_PATIENCE``)."""
    import httpx

    from tests.e2e.test_http_api import Served

    home.sleep_tool(concurrency=1)
    cgateway.sync_tools()
    cworkers(1, queues="tools", concurrency=1)
    busy = cgateway.call_tool("sleep", {"seconds": 3})
    waiting = [cgateway.call_tool("sleep", {"seconds": 0.01}) for _ in range(2)]  # (the limit is 1: behind `busy`)
    wait_until(lambda: cgateway.calls.record(busy.call_id)["state"] == "executing", timeout=10, message="busy to run")
    slot = cgateway.conn.keyslot(keys.queue("tools"))
    served, pool = Served(cgateway), ThreadPoolExecutor(2)
    try:
        with httpx.Client(base_url=served.base, timeout=30) as api:
            with cluster.slot_moving(slot):
                by_client = pool.submit(cgateway.cancel, waiting[0].call_id)
                by_http = pool.submit(api.post, f"/v1/calls/{waiting[1].call_id}/cancel")
                time.sleep(1.5)  # three times what redis-py waits on its own
                assert not by_client.done(), by_client.result()
                assert not by_http.done(), by_http.result().text
            assert by_client.result(30) is True
            reply = by_http.result(30)
            assert reply.status_code == 200 and reply.json()["cancelled"] is True, reply.text
        for h in waiting:
            assert cgateway.calls.record(h.call_id)["state"] == "cancelled"
            with pytest.raises(CallCancelled):
                h.result(timeout=10)
        assert busy.result(timeout=20) == {"slept": 3}
    finally:
        pool.shutdown()
        served.stop()
