"""MCP at /mcp of `hermes-gateway serve`: the `mcp` SDK's streamable HTTP client against real `serve`
processes on loopback, real workers and a real Redis."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from broker import keys
from broker.audit import AuditLog
from tests.conftest import Home, wait_until
from tests.e2e.served import ALICE, LOOKUP_SCHEMA, TP, TRACE, client, configure, serve_processes
from tests.e2e.util import current

pytestmark = pytest.mark.e2e

serve = pytest.fixture(serve_processes)


def test_a_client_lists_what_its_token_may_call_calls_it_and_gets_typed_errors_and_progress(
    home: Home, serve: Any, workers: Any, conn: Any
) -> None:
    configure(home)
    workers(1)
    server = serve()
    progress: list[tuple[float, str | None]] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, message))

    async def session() -> tuple[Any, ...]:
        async with client(server.url, ALICE) as c:
            listed = await c.list_tools()
            found = await c.call_tool("lookup", {"city": "北京"}, meta={"traceparent": TP})
            bad_args = await c.call_tool("lookup", {"city": 42})
            refused = await c.call_tool("wipe", {})
            stepped = await c.call_tool("steps", {"n": 3}, progress_callback=on_progress)
            return c.protocol_version, listed, found, bad_args, refused, stepped

    version, listed, found, bad_args, refused, stepped = asyncio.run(asyncio.wait_for(session(), 60))
    assert version >= "2026"  # the SDK's client speaks the 2026 protocol to it: stateless requests
    tools = {t.name: t for t in listed.tools}
    assert set(tools) == {"lookup", "steps", "sleep", "tight"}  # alice's grants (read_only): not `wipe`
    assert tools["lookup"].description == "Look a thing up" and tools["lookup"].input_schema == LOOKUP_SCHEMA

    assert not found.is_error and found.structured_content == {"city": "北京"}
    assert bad_args.is_error and bad_args.content[0].text.startswith("invalid_args: ")
    assert refused.is_error and refused.content[0].text.startswith("unknown_tool: ")  # (not listed: as unknown)
    assert not stepped.is_error and stepped.structured_content == {"steps": 3}
    assert progress == [(1.0, "step 1 of 3"), (2.0, "step 2 of 3"), (3.0, "step 3 of 3")]

    # Ordinary calls, run as the token's principal; the caller's trace continues.
    records = wait_until(
        lambda: (r := AuditLog(conn).list(principal="alice", limit=20)) and len(r) >= 4 and r, 10,
        message="the calls' audit records",
    )
    by_tool = {r.tool_name: r for r in records}
    assert by_tool["wipe"].state == "failed" and by_tool["wipe"].error_type == "permission_denied"
    looked_up = [r for r in records if r.tool_name == "lookup" and r.state == "done"][0]
    assert looked_up.trace_id == TRACE and looked_up.principal == "alice"  # (an ended call's audit record)


def test_wrong_or_missing_token_is_401_a_foreign_origin_403_and_a_body_over_the_limit_413(
    home: Home, serve: Any
) -> None:
    configure(home)
    server = serve(env={"HERMES_API_MAX_BODY": "4096"})
    init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    missing = httpx.post(server.url, json=init, headers=headers)
    wrong = httpx.post(server.url, json=init, headers={**headers, "Authorization": "Bearer nope"})
    foreign = httpx.post(
        server.url, json=init, headers={**headers, "Authorization": f"Bearer {ALICE}", "Origin": "http://evil.example"}
    )
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "unauthorized"
    assert foreign.status_code == 403 and foreign.json()["error"]["type"] == "forbidden"

    ok = httpx.post(server.url, json=init, headers={**headers, "Authorization": f"Bearer {ALICE}"})
    assert ok.status_code == 200, ok.text  # the same request with alice's token passes the guard
    big = {**init, "params": {"_meta": {"pad": "x" * 5000}}}
    too_large = httpx.post(server.url, json=big, headers={**headers, "Authorization": f"Bearer {ALICE}"})
    assert too_large.status_code == 413


@pytest.mark.parametrize(
    ("mode", "serve_args"),
    [("auto", ()), ("legacy", ("--mcp-stateful",)), ("legacy", ())],
    ids=["2026-stateless", "handshake-stateful", "handshake-stateless"],
)
def test_a_call_the_client_cancels_ends_cancelled_on_the_queue(
    home: Home, serve: Any, workers: Any, conn: Any, mode: str, serve_args: tuple[str, ...]
) -> None:
    # 2026: the client closes the response stream; handshake era: it sends notifications/cancelled, which a
    # stateless server cannot tie to the request (it lands on a transport of its own): there the call is
    # cancelled when the client leaves (its response stream closes).
    on_cancel = mode != "legacy" or bool(serve_args)
    configure(home)
    workers(1)
    server = serve(*serve_args)

    async def session() -> None:
        async with client(server.url, ALICE, mode=mode) as c:
            task = asyncio.get_running_loop().create_task(c.call_tool("sleep", {"seconds": 30}))
            wait_running = asyncio.get_running_loop().run_in_executor(None, running_sleep)
            await asyncio.wait_for(wait_running, 20)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            if on_cancel:  # still connected: it is the cancel that stops the call, not the client leaving
                loop = asyncio.get_running_loop()
                await asyncio.wait_for(loop.run_in_executor(None, cancelled), 20)
            assert (await c.call_tool("lookup", {"city": "after"})).structured_content == {"city": "after"}
        if not on_cancel:
            await asyncio.get_running_loop().run_in_executor(None, cancelled)

    def cancelled() -> None:
        (call_id,) = _jobs(conn, "sleep")
        wait_until(lambda: current(conn, [call_id])[call_id] == "cancelled", 15, message="the call cancelled")

    def running_sleep() -> str:
        def found() -> str | None:
            records = [e for e in _jobs(conn, "sleep") if current(conn, [e])[e] == "executing"]
            return records[0] if records else None

        return wait_until(found, 20, message="the sleep call running on a worker")

    asyncio.run(asyncio.wait_for(session(), 60))
    record = wait_until(lambda: AuditLog(conn).list(tool="sleep", limit=5), 10, message="its audit record")
    assert record[0].state == "cancelled" and record[0].principal == "alice"


def _jobs(conn: Any, tool: str) -> list[str]:
    """The call ids of ``tool``'s calls in the broker."""
    found = []
    for key in conn.scan_iter(match=keys.job("*"), count=1000):
        if conn.hget(key, keys.F_TOOL) == tool.encode():  # (an ended call keeps its tool, not its envelope)
            found.append(key.decode()[len(keys.job("")) :])
    return found


LATE = {"name": "late", "executor": "python", "function": "workers.executors.builtin:echo", "permissions": ["read_only"]}


def test_a_tool_registered_while_connected_is_announced_on_a_listen_stream_and_callable(
    home: Home, serve: Any, workers: Any, gateway: Any
) -> None:
    configure(home)
    workers(1)
    server = serve()  # stateless: the 2026 protocol's subscriptions/listen stream carries the change

    async def session() -> tuple[Any, Any, Any, Any]:
        async with client(server.url, ALICE) as c:
            before = await c.list_tools()
            async with c.listen(tools_list_changed=True) as sub:
                gateway.register_tool(LATE)
                event = await asyncio.wait_for(anext(aiter(sub)), 10)
            after = await c.list_tools()
            return before, event, after, await c.call_tool("late", {"x": 1})

    before, event, after, called = asyncio.run(asyncio.wait_for(session(), 60))
    assert "late" not in {t.name for t in before.tools}
    assert type(event).__name__ == "ToolsListChanged"
    assert "late" in {t.name for t in after.tools}
    assert not called.is_error and called.structured_content == {"x": 1}


def test_with_mcp_stateful_a_handshake_era_session_gets_tools_list_changed(
    home: Home, serve: Any, workers: Any, gateway: Any
) -> None:
    # The handshake-era protocol, as the Hermes agent's mcp 1.x client speaks it: the notification
    # needs a session's GET stream, so `serve --mcp-stateful`.
    configure(home)
    workers(1)
    server = serve("--mcp-stateful")
    changed = asyncio.Event()
    notices: list[str] = []

    async def on_message(message: Any) -> None:
        root = getattr(message, "root", message)
        if "ToolListChanged" in type(root).__name__:
            notices.append(type(root).__name__)
            changed.set()

    async def session() -> tuple[Any, Any, Any, Any]:
        async with client(server.url, ALICE, mode="legacy", message_handler=on_message) as c:
            before = await c.list_tools()
            gateway.register_tool(LATE)
            await asyncio.wait_for(changed.wait(), 10)
            after = await c.list_tools()
            return c.protocol_version, before, after, await c.call_tool("late", {"x": 2})

    version, before, after, called = asyncio.run(asyncio.wait_for(session(), 60))
    assert version < "2026"
    assert "late" not in {t.name for t in before.tools} and "late" in {t.name for t in after.tools}
    assert notices == ["ToolListChangedNotification"]
    assert not called.is_error and called.structured_content == {"x": 2}


class RoundRobin(httpx2.AsyncHTTPTransport):
    """What a load balancer in front of several `serve` does: each request to the next one in turn."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__()
        self.ports, self.sent = ports, []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        port = self.ports[len(self.sent) % len(self.ports)]
        self.sent.append(port)
        request.url = request.url.copy_with(port=port)
        request.headers["host"] = f"127.0.0.1:{port}"
        return await super().handle_async_request(request)


def test_two_serve_processes_on_one_redis_answer_one_client_alternately(
    home: Home, serve: Any, workers: Any, conn: Any
) -> None:
    configure(home)
    workers(1)
    first, second = serve(), serve()
    balancer = RoundRobin([first.port, second.port])
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {ALICE}"}, transport=balancer, timeout=60)

    async def session() -> list[Any]:
        async with Client(streamable_http_client(first.url, http_client=http), cache=None) as c:
            listed = await c.list_tools()
            calls = [await c.call_tool("lookup", {"city": f"c{i}"}) for i in range(4)]
            return [listed, *calls]

    listed, *calls = asyncio.run(asyncio.wait_for(session(), 60))
    assert {"lookup", "steps", "sleep", "tight"} <= {t.name for t in listed.tools}
    assert [c.structured_content for c in calls] == [{"city": f"c{i}"} for i in range(4)]
    assert [c.is_error for c in calls] == [False] * 4
    assert balancer.sent.count(first.port) >= 3 and balancer.sent.count(second.port) >= 3
    assert all(a != b for a, b in zip(balancer.sent, balancer.sent[1:], strict=False))


def test_a_full_queue_and_an_open_circuit_are_tool_errors_saying_so_for_a_handshake_era_client(
    home: Home, serve: Any, workers: Any, conn: Any
) -> None:
    configure(home)
    failing = [sys.executable, "-c", "import sys; sys.exit(4)"]
    home.tool("down", "command", command=failing, permissions=["read_only"], breaker={"failures": 2, "cooldown": 120})
    workers(1)
    server = serve()

    async def session() -> tuple[str, Any, Any, Any]:
        async with client(server.url, ALICE, mode="legacy") as c:
            first = asyncio.get_running_loop().create_task(c.call_tool("tight", {"seconds": 2}))
            while not _jobs(conn, "tight"):  # submitted: it holds the tool's only slot, and its queue takes none
                await asyncio.sleep(0.05)
            refused = await c.call_tool("tight", {"seconds": 0})
            unknown = await c.call_tool("nope", {})
            down = [await c.call_tool("down", {}) for _ in range(3)]  # two failures open its breaker
            return c.protocol_version, refused, unknown, down, await first

    version, refused, unknown, down, first = asyncio.run(asyncio.wait_for(session(), 60))
    assert version < "2026"  # the handshake era, served statelessly
    assert refused.is_error and refused.content[0].text.startswith("queue_full: ")
    assert unknown.is_error and unknown.content[0].text.startswith("unknown_tool: ")
    assert [r.is_error for r in down] == [True] * 3
    assert [r.content[0].text.split(":")[0] for r in down] == ["executor_error", "executor_error", "circuit_open"]
    assert not first.is_error


def test_without_the_mcp_extra_serve_still_runs_and_mcp_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, gateway: Any
) -> None:
    from starlette.testclient import TestClient

    import workers.executors.mcp_session as mcp_executor
    from hermes_gateway.http_api import create_app

    real = mcp_executor.require_sdk

    def missing(what: str = "the mcp executor") -> None:
        monkeypatch.setattr("builtins.__import__", _refusing_mcp(__import__))
        try:
            real(what)
        finally:
            monkeypatch.undo()

    monkeypatch.setattr(mcp_executor, "require_sdk", missing)
    with TestClient(create_app(gateway), base_url="http://127.0.0.1") as client:
        assert client.get("/healthz").status_code == 200
        answer = client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert answer.status_code == 501
    assert "pip install 'hermes-gateway[mcp]'" in answer.json()["error"]["message"]


def _refusing_mcp(real_import: Any) -> Any:
    def refusing(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "mcp" or name.startswith("mcp."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    return refusing


def test_the_mcp_client_in_the_docs_runs_as_printed(
    home: Home, serve: Any, workers: Any, gateway: Any, tmp_path: Any
) -> None:
    import os
    import re
    import subprocess
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "http-and-mcp.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "streamable_http_client" in b)
    configure(home)
    home.tool("hello", executor="command", command="echo Hello, {{name}}!", permissions=["read_only"],
              input_schema={"type": "object", "properties": {"name": {"type": "string"}}})  # fmt: skip
    workers(1)
    server = serve()
    (tmp_path / "mcp_client.py").write_text(block, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env.update(HERMES_GATEWAY_MCP_URL=server.url, HERMES_GATEWAY_TOKEN=ALICE, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "mcp_client.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().rstrip("\n") for _ in range(2)]
        assert lines[1] == "Hello, Alice!", lines
        assert "hello" in lines[0] and "wipe" not in lines[0]  # what alice's token may call
        added: list[str] = []

        def registered_while_it_listens() -> bool:  # one more tool each poll, until it saw one and left
            if proc.poll() is not None:
                return True
            added.append(f"late{len(added)}")
            gateway.register_tool({**LATE, "name": added[-1]})
            return False

        wait_until(registered_while_it_listens, timeout=20, interval=0.25, message="the listen stream")
        rest = proc.stdout.read().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    assert proc.returncode == 0, rest
    assert rest and rest[0].startswith("tools now: ") and "late0" in rest[0], rest


def test_nan_or_infinity_in_arguments_is_invalid_args_and_a_results_text_is_strict_json(
    home: Home, serve: Any, workers: Any, conn: Any
) -> None:
    """The SDK reads NaN and Infinity: such arguments reached the tool (the HTTP API refuses them); and a
    result holding one came back as text no JSON reader takes ('Infinity'), bytes as a Python repr."""
    import json

    configure(home)
    home.tool("odd", function="tests.workers.executors.pyfuncs:non_finite", permissions=["read_only"])
    workers(1)
    server = serve()
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "Authorization": f"Bearer {ALICE}"}

    def call(name: str, arguments: bytes) -> dict[str, Any]:
        body = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"%s","arguments":%s}}'
        response = httpx.post(server.url, content=body % (name.encode(), arguments), headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        data = next(line for line in response.text.splitlines() if line.startswith("data:"))
        return json.loads(data[5:])["result"]

    for arguments in (b'{"city": "x", "n": Infinity}', b'{"city": "x", "n": [NaN]}', b'{"city": "x", "n": -Infinity}'):
        refused = call("lookup", arguments)
        assert refused["isError"] and refused["content"][0]["text"].startswith("invalid_args: arguments hold NaN")
    assert _jobs(conn, "lookup") == []  # refused before anything was submitted
    odd = call("odd", b"{}")
    assert not odd["isError"]
    assert json.loads(odd["content"][0]["text"], parse_constant=lambda c: 1 / 0) == {"nan": None, "inf": None, "ok": 1.5}
