"""`hermes-gateway mcp serve`: the directory served to a real MCP client (the `mcp` SDK's, over stdio),
every call run by real worker processes through the gateway (policy, audit, events)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from broker.audit import AuditLog
from tests.conftest import Home, wait_until
from workers.executors.mcp_session import client_for

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).parent / "hermes-gateway")


def _client(server: dict[str, Any]) -> Any:
    return client_for(server, 1 << 24, lambda: None)  # (a message of up to 16 MiB)


def _server(home: Home, redis_url: str, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env.update(HERMES_REDIS_URL=redis_url, HERMES_HOME=str(home.path))
    return {"command": [CLI, "mcp", "serve", *args], "env": env, "stderr": "discard"}


def test_an_mcp_client_lists_what_its_principal_may_call_and_calls_it_through_the_workers(
    home: Home, redis_url: str, gateway: Any, workers: Any, conn: Any
) -> None:
    home.config({"policy": {"mode": "strict", "principals": {"reader": {"grants": ["read_only"]}}}})
    home.echo_tool("lookup", permissions=["read_only"], description="Look a thing up",
                   input_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    home.tool("broken", "command", command=[sys.executable, "-c", "import sys; sys.exit(4)"], permissions=["read_only"])
    home.noop_tool("wipe", permissions=["admin"])
    workers(1)
    server = _server(home, redis_url, "--principal", "reader", "--session-id", "mcp-s1")

    async def session() -> tuple[Any, ...]:
        async with _client(server) as client:
            listed = await client.list_tools()
            found = await client.call_tool("lookup", {"city": "北京"})
            bad_args = await client.call_tool("lookup", {"city": 42})
            failed = await client.call_tool("broken", {})
            refused = await client.call_tool("wipe", {})
            # A tool registered while the client is connected is there when it lists again.
            gateway.register_tool({"name": "late", "executor": "python", "function": "workers.executors.builtin:noop",
                                   "permissions": ["read_only"]})
            again = await client.list_tools(cache_mode="refresh")
            return listed, found, bad_args, failed, refused, again

    listed, found, bad_args, failed, refused, again = asyncio.run(session())

    tools = {t.name: t for t in listed.tools}
    assert set(tools) == {"lookup", "broken"}  # strict policy: `wipe` needs admin, which reader lacks
    assert tools["lookup"].description == "Look a thing up"
    assert tools["lookup"].input_schema["required"] == ["city"]
    assert "late" in {t.name for t in again.tools}

    assert not found.is_error and found.structured_content == {"city": "北京"}
    assert found.content[0].text == '{"city": "北京"}'
    assert bad_args.is_error and bad_args.content[0].text.startswith("invalid_args: ")
    assert failed.is_error and failed.content[0].text.startswith("executor_error: ")
    assert refused.is_error and refused.content[0].text.startswith("unknown_tool: ")  # (not listed: as unknown)

    # Ordinary calls: audited with the principal and the session the server was started with.
    log = AuditLog(conn)
    def ours() -> list[Any] | None:
        found = [r for r in log.list(principal="reader", limit=50) if r.session_id == "mcp-s1"]
        return found if len(found) >= 4 else None

    records = wait_until(ours, 10, message="the four calls' audit records")
    assert {(r.tool_name, r.state, r.principal) for r in records} >= {
        ("lookup", "done", "reader"), ("broken", "failed", "reader"), ("wipe", "failed", "reader"),
    }


def test_a_tool_its_principal_may_not_call_is_answered_as_one_that_does_not_exist(
    home: Home, redis_url: str, gateway: Any, workers: Any
) -> None:
    # With a broker URL the server checks for workers first: a denied tool on a queue no worker serves
    # answered no_workers, a denied one with workers permission_denied, a missing one unknown_tool.
    home.config({"policy": {"mode": "strict", "principals": {"reader": {"grants": ["read_only"]}}}})
    home.echo_tool("lookup", permissions=["read_only"])
    home.noop_tool("wipe", permissions=["admin"])
    home.noop_tool("vault", permissions=["admin"], queue="vault-only")
    workers(1)

    async def session() -> tuple[Any, list[str]]:
        async with _client(_server(home, redis_url, "--principal", "reader")) as client:
            answers = [await client.call_tool(name, {}) for name in ("wipe", "vault", "no_such_tool")]
            assert all(a.is_error for a in answers)
            return await client.list_tools(), [a.content[0].text.replace(name, "NAME") for a, name in
                                              zip(answers, ("wipe", "vault", "no_such_tool"), strict=True)]

    listed, texts = asyncio.run(session())
    assert [t.name for t in listed.tools] == ["lookup"]
    assert texts[0] == texts[1] == texts[2] and texts[0].startswith("unknown_tool: "), texts


def test_without_a_broker_url_it_starts_the_embedded_broker_and_a_worker_and_keeps_stdout_for_mcp(home: Home) -> None:
    # The seed's hello tool, served with nothing else running: what a local agent's MCP config would start.
    (home.tools_dir / "hello.yaml").write_text(
        "name: hello\nexecutor: command\ncommand: echo Hello, {{name}}!\n"
        "input_schema:\n  type: object\n  properties:\n    name:\n      type: string\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env["HERMES_HOME"] = str(home.path)
    server = {"command": [CLI, "mcp", "serve"], "env": env, "stderr": "discard"}

    async def session() -> tuple[Any, Any]:
        async with _client(server) as client:
            return await client.list_tools(), await client.call_tool("hello", {"name": "Alice"})

    listed, said = asyncio.run(asyncio.wait_for(session(), 90))
    assert [t.name for t in listed.tools] == ["hello"]
    assert not said.is_error and said.content[0].text == "Hello, Alice!"


def test_a_directory_change_is_announced_so_the_client_lists_again(home: Home, redis_url: str, gateway: Any, workers: Any) -> None:
    # The handshake-era protocol, as the Hermes agent's MCP client (mcp 1.x) speaks it: on
    # notifications/tools/list_changed it lists again, so an agent sees new tools without a restart.
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    home.echo_tool("first")
    workers(1)
    server = _server(home, redis_url)
    notices: list[str] = []
    changed = asyncio.Event()

    async def on_message(message: Any) -> None:
        root = getattr(message, "root", message)
        if "ToolListChanged" in type(root).__name__:
            notices.append(type(root).__name__)
            changed.set()

    async def session() -> tuple[Any, Any]:
        params = StdioServerParameters(command=server["command"][0], args=server["command"][1:], env=server["env"])
        with open(os.devnull, "w") as devnull:
            async with Client(stdio_client(params, errlog=devnull), mode="legacy", message_handler=on_message, cache=None) as client:
                before = await client.list_tools()
                gateway.register_tool({"name": "second", "executor": "python", "function": "workers.executors.builtin:noop"})
                await asyncio.wait_for(changed.wait(), 10)
                return before, await client.list_tools()

    before, after = asyncio.run(session())
    assert [t.name for t in before.tools] == ["first"]
    assert [t.name for t in after.tools] == ["first", "second"]
    assert len(notices) == 1


def test_calls_run_side_by_side_and_one_the_client_abandons_is_cancelled(
    home: Home, redis_url: str, gateway: Any, workers: Any, conn: Any
) -> None:
    home.sleep_tool(concurrency=16)
    workers(1, concurrency=16)
    server = _server(home, redis_url)

    async def session() -> list[Any]:
        async with _client(server) as client:
            done = await asyncio.gather(*(client.call_tool("sleep", {"seconds": 0.5}) for _ in range(12)))
            asyncio.get_running_loop().create_task(client.call_tool("sleep", {"seconds": 30}))
            await asyncio.sleep(1.0)  # it is running on a worker when the client leaves
            return list(done)

    done = asyncio.run(session())
    assert [r.is_error for r in done] == [False] * 12
    log = AuditLog(conn)
    records = wait_until(lambda: (r := log.list(tool="sleep", limit=20)) and len(r) == 13 and r, 20,
                         message="13 audit records")
    # The 12 ran side by side (more than the default thread pool's 6 at once) ...
    overlaps = sorted((r.ts - r.duration_ms / 1000, r.ts) for r in records if r.state == "done")
    assert max(sum(1 for s, e in overlaps if s <= start < e) for start, _ in overlaps) >= 8
    # ... and the abandoned one was cancelled in the gateway, not left to run its 30 s.
    assert [r.state for r in records if r.state != "done"] == ["cancelled"]


def test_a_broker_that_cannot_be_reached_is_a_plain_error_not_a_traceback(home: Home) -> None:
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env.update(HERMES_HOME=str(home.path), HERMES_REDIS_URL="redis://127.0.0.1:1/0")
    out = subprocess.run([CLI, "mcp", "serve"], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""  # nothing on the protocol's stream
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def test_killing_the_server_takes_its_worker_and_embedded_broker_with_it(home: Home) -> None:
    import signal
    import subprocess

    import psutil

    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env["HERMES_HOME"] = str(home.path)
    proc = subprocess.Popen([CLI, "mcp", "serve"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        def children() -> list[Any] | None:
            kids = psutil.Process(proc.pid).children()
            names = " ".join(" ".join(k.cmdline()) for k in kids)
            return kids if "redis-server" in names and "workers" in names else None

        kids = wait_until(children, 60, message="the embedded broker and the local worker")
        proc.send_signal(signal.SIGKILL)  # no cleanup of its own: the children must go by themselves
        proc.wait(10)
        gone, alive = psutil.wait_procs(kids, timeout=40)
        assert alive == [], [" ".join(k.cmdline()) for k in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_newer_protocol_client_hears_of_a_change_on_its_listen_stream(home: Home, redis_url: str, gateway: Any, workers: Any) -> None:
    # The SDK's default (auto) mode speaks the newer protocol, where changes come on subscriptions/listen.
    home.echo_tool("first")
    workers(1)

    async def session() -> tuple[Any, Any]:
        async with _client(_server(home, redis_url)) as client:
            before = await client.list_tools()
            async with client.listen(tools_list_changed=True) as changes:
                gateway.register_tool({"name": "second", "executor": "python", "function": "workers.executors.builtin:noop"})
                event = await asyncio.wait_for(changes.__anext__(), 10)
            assert type(event).__name__ == "ToolsListChanged"
            return before, await client.list_tools()

    before, after = asyncio.run(session())
    assert [t.name for t in before.tools] == ["first"]
    assert [t.name for t in after.tools] == ["first", "second"]


def test_a_line_that_is_no_json_rpc_message_gets_an_error_reply_and_the_session_goes_on(home: Home, redis_url: str) -> None:
    import json
    import subprocess

    spec = _server(home, redis_url)
    proc = subprocess.Popen(spec["command"], env=spec["env"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    lines = [
        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}),
        json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"\\ud800x","arguments":{}}}',  # lone surrogate
        '{"jsonrpc":"2.0","id":3,"method":"tools/li',  # cut short: no id to read
        '{"hello": "world"}',  # JSON, but no JSON-RPC message
        json.dumps({"jsonrpc": "2.0", "id": 4, "method": "tools/list"}),
    ]
    replies: list[dict[str, Any]] = []
    guard = threading.Timer(60, proc.kill)  # a missing reply fails the test (EOF), never hangs it
    guard.start()
    try:
        proc.stdin.write("\n".join(lines).encode() + b"\n")
        proc.stdin.flush()  # (left open: at end of input the server cancels what it still runs)
        for _ in range(5):  # a reply for every line but the notification, or the read blocks until the kill
            replies.append(json.loads(proc.stdout.readline()))
    finally:
        guard.cancel()
        proc.kill()
        proc.wait()
    assert [r.get("id") for r in replies] == [1, 2, None, None, 4]
    assert [r.get("error", {}).get("code") for r in replies] == [None, -32700, -32700, -32600, None]
    assert replies[-1]["result"] == {"tools": []}
