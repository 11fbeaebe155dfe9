"""The console's routes on the real API server, real workers and the real Redis: the stats stream, /metrics
(serve's and a worker's, parsed with prometheus_client), stopping a worker, the audit view and replay."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.errors import HermesError
from tests.conftest import wait_until
from tests.e2e.test_console import ConsoleServer
from tests.e2e.util import free_port
from workers import policy_store
from workers.telemetry import LATENCY_BOUNDS, latency_bucket

pytestmark = pytest.mark.e2e


@pytest.fixture
def served(gateway: Any, home: Any, workers: Any, request: pytest.FixtureRequest) -> Iterator[ConsoleServer]:
    home.echo_tool()
    gateway.sync_tools()
    workers(1, concurrency=8)
    server = ConsoleServer(gateway, token=getattr(request, "param", None))
    yield server
    server.stop()


def _client(served: ConsoleServer) -> httpx.Client:
    auth = {"Authorization": f"Bearer {served.token}"} if served.token else {}
    return httpx.Client(base_url=served.base, timeout=30, headers=auth)


def _snapshots(client: httpx.Client, until: Any, limit: float = 20.0) -> dict[str, Any]:
    """Read ``/v1/stream/stats`` until a snapshot satisfies ``until``; that snapshot."""
    deadline = time.monotonic() + limit
    with client.stream("GET", "/v1/stream/stats") as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        event = ""
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "stats":
                snap = json.loads(line.split(":", 1)[1])
                if until(snap):
                    return snap
            assert time.monotonic() < deadline, "no snapshot matched in time"
    raise AssertionError("the stream ended")


def _calls_total(text: str) -> float:
    return sum(
        s.value for fam in text_string_to_metric_families(text) if fam.name == "hermes_calls"
        for s in fam.samples if s.name == "hermes_calls_total"
    )


def test_latency_buckets_use_prometheus_le_bounds() -> None:
    assert latency_bucket(0.0) == 0 and latency_bucket(LATENCY_BOUNDS[0]) == 0
    assert latency_bucket(LATENCY_BOUNDS[0] + 1e-9) == 1
    assert latency_bucket(1e9) == len(LATENCY_BOUNDS)


def test_the_stats_stream_carries_calls_latency_queues_slots_and_workers(served: ConsoleServer, gateway: Any) -> None:
    with _client(served) as client:
        config = client.get("/v1/console").json()
        assert config["token"] is False and config["trace_url"] is None and config["stats_interval"] > 0
        handles = [gateway.call_tool("echo", {"i": i}) for i in range(20)]
        for h in handles:
            h.result(20)
        snap = _snapshots(client, lambda s: s["calls"].get("done", 0) >= 20)
    assert snap["calls"] == {"done": 20}, snap["calls"]
    assert snap["by_tool"] == {"tool:echo": {"done": 20}}
    assert sum(snap["latency"]["counts"]) == 20 and snap["latency"]["bounds"] == list(LATENCY_BOUNDS)
    assert snap["queues"] == {"tools": 0}
    (worker,) = snap["workers"]
    assert worker["concurrency"] == 8 and worker["queues"] == ["tools"] and worker["processed"] >= 20 - 8
    assert worker["late"] is False and worker["version"] and worker["pid"] > 0 and worker["host"]
    (echo,) = [row for row in snap["limits"] if row["key"] == "tool:echo"]
    assert echo["limit"] == 1000 and echo["executing"] == 0 and echo["bottleneck"] is False


def test_serve_metrics_parse_and_count_the_calls_the_workers_ran(
    served: ConsoleServer, gateway: Any, home: Any
) -> None:
    home.tool("boom", function="tests.workers.executors.pyfuncs:explode", timeout=10)
    home.tool("idle", function="tests.workers.executors.pyfuncs:explode", timeout=10, concurrency=3)  # never called
    gateway.sync_tools()
    ok = [gateway.call_tool("echo", {"i": i}) for i in range(17)]
    for h in ok:
        h.result(20)
    with pytest.raises(HermesError):
        gateway.call_tool("boom", {"message": "no"}, max_attempts=1).result(20)
    with _client(served) as client:
        wait_until(lambda: _calls_total(client.get("/metrics").text) >= 18, 10, message="the stats flush")
        time.sleep(1.5)  # a negative check: a bounded wait past another flush (1 s apart): nothing more may come
        page = client.get("/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    families = {fam.name: fam for fam in text_string_to_metric_families(page.text)}
    assert _calls_total(page.text) == 18
    by_state: dict[str, float] = {}
    for s in families["hermes_calls"].samples:
        if s.name == "hermes_calls_total":
            assert s.labels["hermes_call_kind"] == "tool"
            by_state[s.labels["hermes_call_state"]] = by_state.get(s.labels["hermes_call_state"], 0) + s.value
    assert by_state == {"done": 17, "failed": 1}, by_state
    histogram = families["hermes_call_duration_seconds"].samples
    counts = {s.labels["hermes_call_name"]: s.value for s in histogram if s.name.endswith("_count")}
    infs = {s.labels["hermes_call_name"]: s.value for s in histogram if s.labels.get("le") == "+Inf"}
    assert counts == infs == {"echo": 17, "boom": 1}
    assert families["hermes_queue_depth"].samples[0].labels["messaging_destination_name"] == "tools"
    assert [s.value for s in families["hermes_workers"].samples] == [1]
    # every tool's limit, idle as they are now (it read only the keys a submission had written a limit for)
    limits = {s.labels["hermes_concurrency_key"]: s.value for s in families["hermes_concurrency_limit"].samples}
    assert {"tool:echo", "tool:boom"} <= set(limits) and limits["tool:idle"] == 3, limits


def test_the_duration_histogram_leaves_out_calls_refused_before_they_ran(
    served: ConsoleServer, gateway: Any, home: Any
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    home.echo_tool("strict", input_schema=schema)
    gateway.sync_tools()
    for n in (1, 2):
        gateway.call_tool("strict", {"n": n}).result(20)
    for _ in range(3):  # refused by the input schema: the executor never runs
        with pytest.raises(HermesError):
            gateway.call_tool("strict", {"n": "x"}, max_attempts=1).result(20)
    with _client(served) as client:
        wait_until(lambda: _calls_total(client.get("/metrics").text) >= 5, 10, message="the stats flush")
        families = {fam.name: fam for fam in text_string_to_metric_families(client.get("/metrics").text)}
    failed = [s for s in families["hermes_calls"].samples if s.labels.get("error_type") == "invalid_args"]
    assert [s.value for s in failed if s.name == "hermes_calls_total"] == [3]  # counted as refusals
    histogram = families["hermes_call_duration_seconds"].samples
    assert {s.labels["hermes_call_name"]: s.value for s in histogram if s.name.endswith("_count")} == {"strict": 2}


def test_a_worker_serves_its_own_metrics_with_metrics_port(gateway: Any, home: Any, workers: Any) -> None:
    home.echo_tool()
    gateway.sync_tools()
    port = free_port()
    workers(1, env={"HERMES_METRICS_PORT": str(port)})
    for i in range(9):
        gateway.call_tool("echo", {"i": i}).result(20)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert _calls_total(text) == 9
    families = {fam.name: fam for fam in text_string_to_metric_families(text)}
    count = sum(s.value for s in families["hermes_call_duration_seconds"].samples if s.name.endswith("_count"))
    assert count == 9
    assert "hermes_queue_depth" in families


def test_stopping_a_worker_needs_a_token(served: ConsoleServer, workers: Any) -> None:
    name = workers.started[0].name
    with _client(served) as client:
        refused = client.post(f"/v1/workers/{name}/stop", json={})
    assert refused.status_code == 403 and "token" in refused.json()["error"]["message"]
    assert workers.started[0].alive


@pytest.mark.parametrize("served", ["t0ken"], indirect=True)
def test_a_worker_is_stopped_over_the_control_channel(served: ConsoleServer, workers: Any) -> None:
    proc = workers.started[0]
    with _client(served) as client:
        assert client.get("/v1/console").json()["token"] is True
        unknown = client.post("/v1/workers/nobody/stop", json={})
        assert unknown.status_code == 404 and proc.name in unknown.json()["error"]["message"]
        sent = client.post(f"/v1/workers/{proc.name}/stop", json={})
        assert sent.status_code == 200 and sent.json()["listening"] >= 1
        assert client.post(f"/v1/workers/{proc.name}/stop", headers={"Authorization": "Bearer x"}).status_code == 401
    assert proc.wait(20) == 0


def test_audit_filters_by_session_opens_a_record_and_replays_it_unless_policy_refuses(
    served: ConsoleServer, gateway: Any, conn: Any
) -> None:
    from workers.policy import Policy

    mine = gateway.call_tool("echo", {"who": "ann"}, session_id="sess-42", principal="agent-a")
    mine.result(20)
    gateway.call_tool("echo", {"who": "bob"}, session_id="sess-7").result(20)
    with _client(served) as client:
        wait_until(lambda: len(client.get("/v1/audit").json()) == 2, 10, message="both audit records")
        found = client.get("/v1/audit", params={"session": "sess-42"}).json()
        assert [r["call_id"] for r in found] == [mine.call_id]
        assert client.get("/v1/audit", params={"principal": "agent-a", "state": "done", "since": "5m"}).json() == found
        assert client.get("/v1/audit", params={"until": str(time.time() - 3600)}).json() == []
        assert client.get("/v1/audit", params={"since": "yesterday-ish"}).status_code == 400
        for bad in ({"since": "nan"}, {"until": "-1"}, {"since": "1e20"}):  # (not a 500, not a 503)
            r = client.get("/v1/audit", params=bad)
            assert r.status_code == 400 and "out of range" in r.json()["error"]["message"], r.text
        opened = client.get(f"/v1/audit/{mine.call_id}").json()
        assert opened["record"]["args"] == {"who": "ann"} and opened["events"][-1]["state"] == "done"

        again = client.post(f"/v1/audit/{mine.call_id}/replay", json={}).json()
        assert again["state"] == "done" and again["result"] == {"who": "ann"}
        assert again["record"]["principal"] == "agent-a" and "same outcome as recorded" in again["comparison"]

        policy_store.push(conn, Policy.from_dict({"mode": "strict"}), source="test")
        try:
            refused = client.post(f"/v1/audit/{mine.call_id}/replay", json={}).json()
        finally:
            policy_store.clear(conn)
    assert refused["state"] == "failed" and refused["error"]["type"] == "permission_denied", refused
    assert "the outcome differs" in refused["comparison"]


def test_replays_waiting_on_a_busy_tool_hold_none_of_the_threads_other_routes_run_on(
    served: ConsoleServer, gateway: Any, home: Any, conn: Any
) -> None:
    """48 replays waiting on a tool whose one slot is taken (more than the 40 threads of the app's pool):
    /v1/status still answers, and each replay ends done once the slot frees."""
    from concurrent.futures import ThreadPoolExecutor

    from broker import keys

    home.sleep_tool("hold", concurrency=1)
    gateway.sync_tools()
    first = gateway.call_tool("hold", {"seconds": 0.01})
    first.result(20)
    blocker = gateway.call_tool("hold", {"seconds": 30})
    wait_until(lambda: blocker.state == "executing", 20, message="the blocker to take the slot")
    waiting = keys.waiting(keys.tag("tools"), "tool:hold")

    def replay(_i: int) -> dict[str, Any]:
        with _client(served) as client:
            return client.post(f"/v1/audit/{first.call_id}/replay", json={"timeout": 60}, timeout=90).json()

    with ThreadPoolExecutor(48) as pool, _client(served) as client:
        wait_until(lambda: len(client.get("/v1/audit").json()) == 1, 10, message="the first call's record")
        replays = [pool.submit(replay, i) for i in range(48)]
        wait_until(lambda: conn.zcard(waiting) == 48, 30, message="every replay's call waiting for the slot")
        status = client.get("/v1/status", timeout=10)  # (a pool held by the 48 waits: no answer for 60 s)
        assert status.status_code == 200, status.text
        assert blocker.cancel()
        outcomes = [r.result(90) for r in replays]
    assert [o["state"] for o in outcomes] == ["done"] * 48, outcomes[:3]
    assert {o["record"]["replay_of"] for o in outcomes} == {first.call_id}


def test_the_tool_list_shows_the_effective_concurrency(served: ConsoleServer, gateway: Any) -> None:
    gateway.register_tool({"name": "plain", "executor": "python", "function": "workers.executors.builtin:echo"})
    with _client(served) as client:
        tools = {t["name"]: t for t in client.get("/v1/tools").json()}
    assert tools["plain"]["concurrency"] is None and tools["plain"]["concurrency_effective"] == 5
    assert tools["echo"]["concurrency"] == tools["echo"]["concurrency_effective"] == 1000  # its own


def test_the_page_has_the_live_views_and_loads_its_chart_library_from_the_package(served: ConsoleServer) -> None:
    from importlib import resources

    with _client(served) as client:
        page = client.get("/").text
        for element in ("chart-calls", "chart-latency", "chart-queues", "limits", "workers", "breakers",
                        "waterfall", "trace-link", "audit-session", "audit-rows", "audit-replay"):
            assert f'id="{element}"' in page, element
        assert '<script src="static/uPlot.iife.min.js"></script>' in page  # relative: same origin, offline
        js = client.get("/static/uPlot.iife.min.js")
        css = client.get("/static/uPlot.min.css")
    assert js.status_code == 200 and "uPlot" in js.text and "javascript" in js.headers["content-type"]
    assert css.status_code == 200 and ".uplot" in css.text
    licence = resources.files("hermes_gateway").joinpath("static/uPlot.LICENSE").read_text(encoding="utf-8")
    assert "MIT" in licence or "Permission is hereby granted" in licence
