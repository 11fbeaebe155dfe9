"""The HTTP/SSE API and console: a real uvicorn server, real worker processes, a real Redis, httpx."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from broker.config import load_settings
from hermes_gateway.http_api import create_app
from tests.e2e.util import free_port, wait_http

pytestmark = pytest.mark.e2e

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TP = f"00-{TRACE}-00f067aa0ba902b7-01"


class Served:
    def __init__(self, gateway: Any, token: str | None = None) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            create_app(gateway, token=token), host="127.0.0.1", port=self.port, log_level="warning",
            timeout_graceful_shutdown=1,  # a browser page still holding an event stream does not delay the stop
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the API server did not start"
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def api(gateway: Any, home: Any, workers: Any) -> Iterator[httpx.Client]:
    home.echo_tool()
    home.sleep_tool()
    home.sleep_tool("tight", concurrency=1, queue_size=0)
    home.tool("nan", function="tests.workers.executors.pyfuncs:non_finite", timeout=10)
    gateway.sync_tools()
    workers(1, concurrency=8)
    served = Served(gateway)
    with httpx.Client(base_url=served.base, timeout=30) as client:
        yield client
    served.stop()


def _sse(client: httpx.Client, path: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every SSE event of ``path`` until the server ends the stream."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    with client.stream("GET", path, headers=headers or {}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                if "data" in current:
                    events.append(current)
                current = {}
            elif not line.startswith(":"):
                field, _, value = line.partition(":")
                current[field] = value.lstrip(" ")
    return events


def test_register_list_call_and_stream_a_tool_over_http(api: httpx.Client, gateway: Any) -> None:
    assert api.get("/healthz").json()["ok"] is True

    bad = api.post("/v1/tools", json={"name": "greet", "executor": "python"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_spec"
    assert "function" in bad.json()["error"]["message"]
    spec = {
        "name": "greet",
        "executor": "python",
        "function": "workers.executors.builtin:echo",
        "description": "says what it got",
        "input_schema": {"type": "object", "properties": {"who": {"type": "string"}}},
    }
    created = api.post("/v1/tools", json=spec)
    assert created.status_code == 201 and created.json()["outcome"] == "added"
    assert api.post("/v1/tools", json=spec).json()["outcome"] == "unchanged"
    assert "greet" in {t["name"] for t in api.get("/v1/tools").json()}
    assert api.get("/v1/tools/greet").json()["description"] == "says what it got"
    assert {s["function"]["name"] for s in api.get("/v1/schemas").json()} >= {"greet", "echo"}

    done = api.post(
        "/v1/tools/greet/calls", json={"args": {"who": "北京"}, "wait": 20}, headers={"traceparent": TP}
    )
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["state"] == "done" and body["result"] == {"who": "北京"}
    # The caller's trace continues through the API (the ended call's terminal event carries its trace id).
    assert gateway.calls.record(body["call_id"])["trace_id"] == TRACE, "the caller's trace continues through the API"

    accepted = api.post(
        "/v1/tools/sleep/calls", json={"args": {"seconds": 0.2}, "context": {"session_id": "s-1"}}
    )
    assert accepted.status_code == 202
    call = accepted.json()
    events = _sse(api, call["events"])
    states = [json.loads(e["data"])["state"] for e in events if e["event"] == "transition"]
    assert states == ["pending", "routing", "executing", "formatting", "done"]
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
    assert json.loads(events[-1]["data"])["session_id"] == "s-1"
    # Reconnecting with Last-Event-ID gets only what came after.
    tail = _sse(api, call["events"], headers={"Last-Event-ID": "3"})
    assert [int(e["id"]) for e in tail] == list(range(4, len(events) + 1))
    got = api.get(f"/v1/calls/{call['call_id']}").json()
    assert got["state"] == "done" and got["result"] == {"slept": 0.2}

    assert api.delete("/v1/tools/greet").json() == {"removed": "greet"}
    assert api.delete("/v1/tools/greet").status_code == 404


def test_admission_errors_are_typed_http_errors_and_failures_are_outcomes(api: httpx.Client) -> None:
    missing = api.post("/v1/tools/nope/calls", json={"args": {}})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "unknown_tool"
    assert (
        api.post(
            "/v1/tools/echo/calls", content=b"{not json", headers={"Content-Type": "application/json"}
        ).status_code
        == 400
    )
    # A body that is not declared JSON is refused: a cross-site form or no-cors fetch cannot declare it.
    plain = api.post("/v1/tools/echo/calls", content=b'{"args": {}}', headers={"Content-Type": "text/plain"})
    assert plain.status_code == 400 and "application/json" in plain.json()["error"]["message"]
    for field, value in (("wait", -1), ("timeout", 0), ("max_attempts", 0)):
        refused = api.post(
            "/v1/tools/echo/calls",
            content=json.dumps({field: value}),
            headers={"Content-Type": "application/json"},
        )
        assert refused.status_code == 400 and field in refused.json()["error"]["message"], (field, value)
    # NaN and Infinity are not JSON (JSON.parse, Go and Java refuse them): refused wherever they stand.
    for body in ('{"wait": NaN}', '{"args": {"x": Infinity}}', '{"args": {"x": -Infinity}}', '{"args": {"x": 1e400}}'):
        refused = api.post("/v1/tools/echo/calls", content=body, headers={"Content-Type": "application/json"})
        assert refused.status_code == 400 and "is not a JSON number" in refused.json()["error"]["message"], (
            body
        )
    queue = api.post("/v1/tools/echo/calls", json={"context": {"queue": "elsewhere"}})
    assert queue.status_code == 400 and "queue" in queue.json()["error"]["message"]
    wrong = api.post("/v1/tools/echo/calls", json={"args": [1, 2]})
    assert wrong.status_code == 400 and "args: expected an object" in wrong.json()["error"]["message"]
    typo = api.post("/v1/tools/echo/calls", json={"context": {"sesion_id": "x"}})
    assert typo.status_code == 400 and "sesion_id" in typo.json()["error"]["message"]
    # Naming plugins "already applied" would make the workers skip their middleware and hooks (guardrails):
    # only the Hermes plugin may, over Redis; over HTTP it is refused, as is the replay route's field.
    listed = api.post("/v1/tools/echo/calls", json={"args": {}, "context": {"session_id": ["a"]}})
    assert listed.status_code == 400 and "context field session_id must be text" in listed.json()["error"]["message"]
    for field in ("plugins_applied", "replay_of"):
        skip = api.post("/v1/tools/echo/calls", json={"args": {}, "context": {field: "x"}})
        assert skip.status_code == 400 and field in skip.json()["error"]["message"], field

    first = api.post("/v1/tools/tight/calls", json={"args": {"seconds": 20}})
    assert first.status_code == 202
    second = api.post("/v1/tools/tight/calls", json={"args": {"seconds": 0}})  # slot taken, no room to wait
    assert second.status_code == 429 and second.json()["error"]["type"] == "queue_full"
    assert second.json()["error"]["details"]["limit"] == 0
    api.post(f"/v1/calls/{first.json()['call_id']}/cancel")

    bad_args = api.post("/v1/tools/sleep/calls", json={"args": {"seconds": "soon"}, "wait": 20})
    assert bad_args.status_code == 200
    assert bad_args.json()["state"] == "failed" and bad_args.json()["error"]["type"] == "invalid_args"
    assert api.get("/v1/calls/0123456789abcdef0123456789abcdef").status_code == 404


def test_every_error_body_has_the_one_shape_even_no_route_no_method_and_a_crash(
    api: httpx.Client, monkeypatch: Any
) -> None:
    def shape(r: httpx.Response, status: int, kind: str) -> None:
        assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
        assert set(r.json()) == {"error"} and r.json()["error"]["type"] == kind, r.text
        assert set(r.json()["error"]) <= {"type", "message", "details"} and r.json()["error"]["message"]

    shape(api.get("/v1/nowhere"), 404, "not_found")
    wrong = api.put("/v1/calls/x/cancel")
    shape(wrong, 405, "method_not_allowed")
    assert "POST" in wrong.headers["allow"]
    # A path with a route per method: Allow names them all (Starlette's named the first route's only).
    both = api.put("/v1/tools")
    shape(both, 405, "method_not_allowed")
    assert set(both.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}, both.headers["allow"]
    assert "PUT is not allowed on /v1/tools" in both.json()["error"]["message"]
    monkeypatch.setattr("hermes_gateway.http_api.status_data", lambda *_: 1 / 0)  # a bug in a route
    shape(api.get("/v1/status"), 500, "internal_error")


def test_other_sites_and_rebound_host_names_are_refused(api: httpx.Client) -> None:
    evil = api.post("/v1/tools/echo/calls", json={"args": {}}, headers={"Origin": "http://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["type"] == "forbidden"
    rebound = api.get("/v1/tools", headers={"Host": "evil.example:8787"})
    assert rebound.status_code == 403
    same = api.get("/v1/tools", headers={"Origin": str(api.base_url).rstrip("/")})
    assert same.status_code == 200, "the console's own origin is served"


def test_with_tokens_the_routes_that_take_none_refuse_a_rebound_host_name(
    gateway: Any, monkeypatch: Any
) -> None:
    import dataclasses

    settings = gateway.settings
    monkeypatch.setattr(
        gateway,
        "settings",
        dataclasses.replace(
            settings, api=dataclasses.replace(settings.api, allowed_hosts=frozenset({"gw.internal"}))
        ),
    )
    served = Served(gateway, token="t0ken")
    try:
        with httpx.Client(base_url=served.base, timeout=30) as client:
            port = served.port
            for path in ("/metrics", "/healthz", "/"):
                rebound = client.get(path, headers={"Host": f"evil.example:{port}"})
                assert rebound.status_code == 403 and "allowed_hosts" in rebound.json()["error"]["message"], (
                    path
                )
                for host in (
                    f"127.0.0.1:{port}",
                    f"localhost:{port}",
                    f"10.1.2.3:{port}",
                    f"[::1]:{port}",
                    f"GW.internal:{port}",
                ):
                    assert client.get(path, headers={"Host": host}).status_code == 200, (path, host)
            # a route that takes a token is not a rebinding page's to read: any host name, with the token
            with_token = client.get(
                "/v1/tools", headers={"Host": f"gw.example:{port}", "Authorization": "Bearer t0ken"}
            )
            assert with_token.status_code == 200
    finally:
        served.stop()


def test_a_spec_read_over_http_masks_credentials(api: httpx.Client) -> None:
    spec = {
        "name": "with_key",
        "executor": "http",
        "endpoint": "http://127.0.0.1:9/x",
        "headers": {"Authorization": "Bearer sk-live-123", "X-Trace": "on"},
    }
    assert api.post("/v1/tools", json=spec).status_code == 201
    shown = api.get("/v1/tools/with_key").json()
    assert shown["headers"] == {"Authorization": "***", "X-Trace": "on"}
    assert "sk-live-123" not in json.dumps(shown)


def test_an_ended_calls_event_stream_says_there_is_nothing_more(api: httpx.Client) -> None:
    done = api.post("/v1/tools/echo/calls", json={"wait": 20}).json()
    assert done["state"] == "done"
    events = _sse(api, f"/v1/calls/{done['call_id']}/events")
    last = int(events[-1]["id"])
    again = api.get(f"/v1/calls/{done['call_id']}/events", headers={"Last-Event-ID": str(last)})
    assert again.status_code == 204  # an EventSource stops reconnecting


def test_a_running_call_is_cancelled_over_http(api: httpx.Client) -> None:
    call = api.post("/v1/tools/sleep/calls", json={"args": {"seconds": 30}}).json()
    deadline = time.monotonic() + 10
    while api.get(f"/v1/calls/{call['call_id']}").json()["state"] != "executing":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert api.post(f"/v1/calls/{call['call_id']}/cancel").json()["cancelled"] is True
    ended = api.post("/v1/tools/echo/calls", json={"wait": 20}).json()  # the worker goes on serving
    assert ended["state"] == "done"
    deadline = time.monotonic() + 10
    while (state := api.get(f"/v1/calls/{call['call_id']}").json()["state"]) != "cancelled":
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def test_with_a_token_every_v1_route_wants_it_and_the_console_is_served(
    gateway: Any, home: Any, workers: Any
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    workers(1, concurrency=4)
    served = Served(gateway, token="s3cret")
    try:
        with httpx.Client(base_url=served.base, timeout=30) as client:
            page = client.get("/")
            assert page.status_code == 200 and "<title>Hermes Gateway</title>" in page.text
            assert client.get("/healthz").status_code == 200
            denied = client.get("/v1/tools")
            assert denied.status_code == 401 and denied.json()["error"]["type"] == "unauthorized"
            assert client.get("/v1/tools", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert denied.headers["www-authenticate"] == "Bearer"
            assert client.get("/v1/tools?access_token=s3cret").status_code == 401, "query tokens: events only"
            auth = {"Authorization": "Bearer s3cret"}
            call = client.post("/v1/tools/echo/calls", json={"args": {"a": 1}}, headers=auth).json()
            # EventSource cannot send headers: the token may come as a query parameter.
            events = _sse(client, f"{call['events']}?access_token=s3cret")
            assert json.loads(events[-1]["data"])["state"] == "done"
            status = client.get("/v1/status", headers=auth).json()
            assert "figures" in status and status["workers"]
    finally:
        served.stop()


def _serve(port: int, env: dict[str, str]) -> subprocess.Popen[str]:
    """``hermes-gateway serve --port PORT`` as a process of its own."""
    from tests.conftest import REPO

    return subprocess.Popen(
        [sys.executable, "-c", "from hermes_gateway.cli import main; main()", "serve", "--port", str(port)],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_serve_command_runs_the_api_and_refuses_an_open_address_without_a_token(
    redis_url: str, home: Any
) -> None:
    import os

    from click.testing import CliRunner

    from hermes_gateway.cli import main

    refused = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0"], env={"HERMES_REDIS_URL": redis_url})
    assert refused.exit_code == 2 and "--token" in refused.output

    port = free_port()
    env = dict(os.environ, HERMES_REDIS_URL=redis_url, HERMES_HOME=str(home.path))
    proc = _serve(port, env)
    try:
        health = wait_http(f"http://127.0.0.1:{port}/healthz", proc)
        assert health.json()["ok"] is True and str(port) not in health.json()["broker"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_on_the_embedded_broker_runs_calls_and_sigterm_stops_its_worker_and_broker(home: Any) -> None:
    import os
    import signal

    home.echo_tool()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "HERMES_REDIS_URL"}
    env["HERMES_HOME"] = str(home.path)
    proc = _serve(port, env)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, timeout=40)
        out = httpx.post(
            f"http://127.0.0.1:{port}/v1/tools/echo/calls", json={"args": {"x": 1}, "wait": 20}, timeout=30
        ).json()
        assert out["state"] == "done" and out["result"] == {"x": 1}
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) >= 2, "the embedded broker and one local worker"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0
        for pid in map(int, children):
            deadline = time.monotonic() + 10
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                assert time.monotonic() < deadline, f"child {pid} outlived serve"
                time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_responses_and_events_are_strict_json_and_a_huge_body_is_413(
    api: httpx.Client, gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    strict = {"parse_constant": lambda name: pytest.fail(f"{name} in a response")}
    # A python tool's NaN / infinity go out as null, in the outcome and in the SSE events alike.
    done = api.post("/v1/tools/nan/calls", json={"args": {}, "wait": 20})
    assert json.loads(done.content, **strict)["result"] == {"nan": None, "inf": None, "ok": 1.5}
    events = _sse(api, f"/v1/calls/{done.json()['call_id']}/events")
    last = json.loads(events[-1]["data"], **strict)
    assert last["state"] == "done" and last["detail"]["result"] == {"nan": None, "inf": None, "ok": 1.5}
    monkeypatch.setenv("HERMES_API_MAX_BODY", "1000")
    monkeypatch.setattr(gateway, "settings", load_settings(gateway.settings.home))  # as a `serve` started now reads it
    big = api.post("/v1/tools/echo/calls", json={"args": {"x": "a" * 2000}})
    assert big.status_code == 413 and big.json()["error"]["type"] == "payload_too_large"
    assert "over the limit of 1000" in big.json()["error"]["message"]


def test_an_llm_call_over_http_runs_on_the_workers_and_a_bad_request_is_a_400(
    gateway: Any, home: Any, workers: Any
) -> None:
    """POST /v1/llm/calls: the same operation as call_llm, for callers in any language."""
    from tests.llm_server import LLMServer

    with LLMServer(api_key="sk-http") as llm:
        home.config({"model": {"provider": "openai-compatible", "base_url": llm.base_url, "api_key": "sk-http",
                               "model": "hermes-test"}})  # fmt: skip
        gateway.settings = load_settings(home.path)  # (the client fills the model in from config.yaml)
        workers(1, queues="llm")
        served = Served(gateway)
        try:
            with httpx.Client(base_url=served.base, timeout=30) as client:
                ask = {"messages": [{"role": "user", "content": "Reply exactly ok"}]}
                done = client.post("/v1/llm/calls", json={"request": ask, "wait": 20, "context": {"session_id": "s-h"}})
                assert done.status_code == 200, done.text
                body = done.json()
                assert body["state"] == "done" and body["result"]["choices"][0]["message"]["content"] == "ok"
                assert llm.chat_requests[-1].body["model"] == "hermes-test"
                later = client.post("/v1/llm/calls", json={"request": ask})
                assert later.status_code == 202 and later.json()["events"].startswith("/v1/calls/")
                for bad in ({}, {"request": [1]}, {"request": {"messages": "hi"}}):
                    refused = client.post("/v1/llm/calls", json=bad)
                    assert refused.status_code == 400, (bad, refused.text)
        finally:
            served.stop()


def test_the_server_holds_no_large_result_of_the_ended_calls_it_keeps(api: httpx.Client) -> None:
    """The server keeps its last ended calls' handles (for their event streams): a result too large for
    the terminal event, read from the record for a `wait`, must not stay in memory with each of them."""
    big = "x" * 300_000  # (past the 64 KiB a terminal event carries: read from the call's record)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(40):
            done = api.post("/v1/tools/echo/calls", json={"args": {"s": big, "i": i}, "wait": 20}).json()
            assert done["state"] == "done" and done["result"]["s"] == big
            got = api.get(f"/v1/calls/{done['call_id']}").json()  # (a second read of it, as a front end's)
            assert got["result"]["i"] == i
        del done, got
        gc.collect()  # (the test's own responses, in reference cycles)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 40 * len(big) / 2, f"{grown} bytes still held after 40 calls of {len(big)}-byte results"


def test_the_ended_calls_the_server_keeps_hold_a_bounded_number_of_events(
    api: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call may send thousands of events (an LLM reply streamed a chunk each): the ended calls the server
    keeps for their late followers are bounded by the events they hold, not by their number alone."""
    from hermes_gateway import clientcore

    monkeypatch.setattr(clientcore, "ENDED_EVENTS_KEPT", 3000, raising=False)  # (100,000 in earnest: ~100 MB)
    spec = {"name": "chatty", "executor": "python", "function": "tests.e2e.mcptools:chatty", "timeout": 30}
    assert api.post("/v1/tools", json=spec).status_code == 201
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(12):
            done = api.post("/v1/tools/chatty/calls", json={"args": {"n": 1500}, "wait": 30}).json()
            assert done["state"] == "done", done
        last = _sse(api, f"/v1/calls/{done['call_id']}/events")  # the latest is kept whole for a late follower
        assert sum(e["event"] == "progress" for e in last) == 1500
        del last
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 8_000_000, f"{grown} bytes held after 12 calls of 1,500 events"
