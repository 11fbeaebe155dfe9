"""The mcp executor against a real MCP server, over stdio and over streamable HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from broker.errors import CallCancelled, ExecutorError, InvalidSpec, OutputTooLarge, ToolTimeout
from broker.toolspec import ToolSpec
from tests.conftest import wait_until
from workers.executors import ExecContext
from workers.executors import mcp as mcpexec
from workers.specs import check_spec

from .raw_mcp_server import serve_http

SERVER = str(Path(__file__).with_name("mcp_server.py"))
STDIO = {"command": [sys.executable, SERVER, "stdio"], "stderr": "discard"}
RAW = {"command": [sys.executable, str(Path(__file__).with_name("raw_mcp_server.py"))], "stderr": "discard"}
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def ex():
    executor = mcpexec.McpExecutor({"servers": {"test": STDIO}})
    yield executor
    executor.close()


def _start_http_server(log: Any) -> tuple[subprocess.Popen[bytes], int] | None:
    """The test MCP server on a free port, once it accepts connections (None: it exited first, e.g. the
    port was taken between choosing and binding it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"the test MCP server did not accept connections on port {port} within 30 s")


@pytest.fixture(scope="module")
def http_url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    log_path = tmp_path_factory.mktemp("mcp-http") / "server.log"
    with open(log_path, "wb") as log:
        for _ in range(3):
            started = _start_http_server(log)
            if started is not None:
                break
        else:
            raise RuntimeError(
                f"the test MCP server exited at start three times: {log_path.read_text(errors='replace')}"
            )
        proc, port = started
        yield f"http://127.0.0.1:{port}/mcp"
        proc.terminate()
        proc.wait(5)


def spec(tool: str, server: dict | str = "test", **extra) -> ToolSpec:
    return check_spec({"name": f"t_{tool}", "executor": "mcp", "mcp": server, "tool": tool, **extra})


def test_stdio_tool_call_returns_the_result(ex, make_ctx):
    assert ex.run(spec("greet"), {"name": "Alice"}, make_ctx()) == "Hello, Alice!"


def test_trace_context_travels_in_meta_and_progress_is_reported(ex, make_ctx):
    ctx = make_ctx(traceparent=TP, tracestate="k=v", baggage="tenant=acme")
    out = ex.run(spec("trace"), {}, ctx)
    assert '"traceparent": "' + TP + '"' in out and '"tracestate": "k=v"' in out
    assert '"baggage": "tenant=acme"' in out
    assert ctx.messages == ["half way"]


def test_tool_error_is_a_failed_call_with_the_server_message(ex, make_ctx):
    with pytest.raises(ExecutorError, match="no such city"):
        ex.run(spec("fail"), {"message": "no such city"}, make_ctx())


def test_unknown_tool_is_executor_error(ex, make_ctx):
    with pytest.raises(ExecutorError, match="Unknown tool"):
        ex.run(spec("nope"), {}, make_ctx())


def test_session_is_reused(ex, make_ctx):
    first = ex.run(spec("whoami"), {}, make_ctx())
    assert ex.run(spec("whoami"), {}, make_ctx()) == first


def test_timeout_is_tool_timeout_and_session_survives(ex, make_ctx):
    with pytest.raises(ToolTimeout):
        ex.run(spec("slow"), {"seconds": 30}, make_ctx(timeout=0.5))
    assert ex.run(spec("greet"), {"name": "B"}, make_ctx()) == "Hello, B!"


def test_cancellation_stops_the_call(ex, make_ctx):
    ctx = make_ctx(timeout=30)
    threading.Timer(0.3, ctx.cancelled.set).start()
    with pytest.raises(CallCancelled):
        ex.run(spec("slow"), {"seconds": 30}, ctx)


def test_oversize_result_is_output_too_large(ex, make_ctx):
    with pytest.raises(OutputTooLarge):
        ex.run(spec("big", max_output=10_000), {"size": 50_000}, make_ctx())


def test_many_calls_in_flight_share_one_session(ex, make_ctx):
    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(lambda i: ex.run(spec("greet"), {"name": str(i)}, make_ctx()), range(16)))
    assert out == [f"Hello, {i}!" for i in range(16)]


def test_session_is_re_established_after_the_server_dies(make_ctx):
    executor = mcpexec.McpExecutor({})
    try:
        before = pid_of(executor)
        with pytest.raises(ExecutorError, match="closed the connection"):
            executor.run(spec("die", STDIO), {}, make_ctx(timeout=5))
        after = pid_of(executor)
        assert after != before
        # Killed between calls: the next call notices the dead session and starts a new one.
        os.kill(after, signal.SIGKILL)
        assert wait_gone(after)
        # Until the SDK has read the server's EOF (its session says it is dead): the next call then starts anew.
        wait_until(lambda: not any(s.alive for s in executor._pool._sessions.values()), timeout=5)
        assert pid_of(executor) not in (before, after)
    finally:
        executor.close()


def pid_of(executor) -> int:
    """whoami's dict comes back as the JSON text the server wrote (no structured content)."""
    ctx = ExecContext(call_id="c", tool_name="whoami", timeout=10)
    return json.loads(executor.run(spec("whoami", STDIO), {}, ctx))["pid"]


def wait_gone(pid: int) -> bool:
    for _ in range(100):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


def test_handshake_timeout_is_reported(make_ctx):
    executor = mcpexec.McpExecutor({"handshake_timeout": 0.5})
    slow = {"command": [sys.executable, SERVER, "slowstart", "5"], "stderr": "discard"}
    try:
        with pytest.raises(ExecutorError, match="handshake"):
            executor.run(spec("greet", slow), {"name": "x"}, make_ctx())
    finally:
        executor.close()


def test_missing_server_program_is_executor_error(make_ctx):
    executor = mcpexec.McpExecutor({})
    try:
        with pytest.raises(ExecutorError):
            executor.run(spec("greet", {"command": ["/nonexistent/mcp-server"]}), {"name": "x"}, make_ctx())
    finally:
        executor.close()


def test_bad_server_config_is_spec_error(ex, make_ctx):
    with pytest.raises(InvalidSpec):
        ex.run(spec("greet", {"nothing": 1}), {}, make_ctx())
    with pytest.raises(InvalidSpec):
        ex.run(spec("greet", "unknown-name"), {}, make_ctx())


def test_streamable_http_server(http_url, make_ctx):
    executor = mcpexec.McpExecutor({})
    try:
        assert executor.run(spec("greet", {"url": http_url}), {"name": "Zoe"}, make_ctx()) == "Hello, Zoe!"
        out = executor.run(spec("trace", {"url": http_url}), {}, make_ctx(traceparent=TP))
        assert TP in out
        with pytest.raises(ExecutorError, match="bad"):
            executor.run(spec("fail", {"url": http_url}), {"message": "bad"}, make_ctx())
    finally:
        executor.close()


def test_list_server_tools_gives_tool_specs(http_url):
    specs = mcpexec.list_server_tools(STDIO)
    by_name = {s["name"]: s for s in specs}
    assert {"greet", "add", "slow"} <= set(by_name)
    greet = check_spec(by_name["greet"])
    assert greet.executor == "mcp" and greet.input_schema["required"] == ["name"]
    assert {s["name"] for s in mcpexec.list_server_tools({"url": http_url})} == set(by_name)


def test_imported_specs_return_plain_values_that_fit_their_declared_output_schema(ex, make_ctx):
    # A server wraps a non-object return value as {"result": value}; the imported spec declares the
    # value's schema and unwraps, so `add` style tools return 5, not an invalid_output error.
    from workers.args import check_output

    by_name = {s["name"]: s for s in mcpexec.list_server_tools(STDIO)}
    greet = check_spec({**by_name["greet"], "mcp": "test"})
    assert greet.output_schema is not None and greet.output_schema["type"] == "string"
    assert greet.config["unwrap_result"] is True
    result = ex.run(greet, {"name": "Alice"}, make_ctx())
    assert result == "Hello, Alice!"
    check_output(greet.output_schema, result, "greet")


def test_a_spec_declaring_the_wrapper_itself_keeps_the_wrapper(ex, make_ctx):
    # Imported before unwrap_result existed: its output schema is the wrapper, so the result stays wrapped.
    from workers.args import check_output

    wrapper = {
        "type": "object",
        "title": "greetOutput",
        "properties": {"result": {"type": "string", "title": "Result"}},
        "required": ["result"],
    }
    old = spec("greet", output_schema=wrapper)
    result = ex.run(old, {"name": "Bo"}, make_ctx())
    assert result == {"result": "Hello, Bo!"}
    check_output(wrapper, result, "greet")


def test_wrapped_result_schema_recognises_only_the_sdk_wrapper() -> None:
    inner = {"$ref": "#/$defs/Point"}
    defs = {"Point": {"type": "object"}}
    wrapper = {
        "type": "object",
        "title": "fOutput",
        "properties": {"result": inner},
        "required": ["result"],
        "$defs": defs,
    }
    assert mcpexec.wrapped_result_schema(wrapper) == {"$ref": "#/$defs/Point", "$defs": defs}
    assert (
        mcpexec.wrapped_result_schema({**wrapper, "title": "Point"}) is None
    )  # a model that has a result field
    assert mcpexec.wrapped_result_schema({**wrapper, "required": []}) is None
    assert mcpexec.wrapped_result_schema({"type": "string"}) is None


def test_a_server_that_exits_before_the_handshake_is_named_plainly(tmp_path: Path) -> None:
    crash = tmp_path / "crash.py"
    crash.write_text("raise SystemExit('boom at import')\n")
    with pytest.raises(ExecutorError) as info:
        mcpexec.list_server_tools(
            {"command": [sys.executable, str(crash)], "stderr": "discard"}, handshake_timeout=10
        )
    message = str(info.value)
    assert "closed the connection (it exited?" in message and "ExceptionGroup" not in message, message


def test_a_line_that_is_not_utf8_from_a_stdio_server_spoils_nothing(make_ctx):
    # The SDK decoded strictly: one bad line killed its reader, and every later call to the server waited
    # out its timeout until the worker restarted. Decoded with replacement, the line is dropped as not JSON.
    executor = mcpexec.McpExecutor({"servers": {"raw": RAW}})
    try:
        assert executor.run(spec("garbage", "raw"), {}, make_ctx(timeout=5)) == "after garbage"
        assert executor.run(spec("echo", "raw"), {"a": 1}, make_ctx(timeout=5)) == '{"a": 1}'
    finally:
        executor.close()


def test_a_stdio_answer_that_never_ends_fails_the_call_at_the_cap_and_the_server_is_restarted(make_ctx):
    # The SDK buffered a line until its newline: a result of no end grew the worker until its memory ran out.
    executor = mcpexec.McpExecutor({"servers": {"raw": RAW}, "max_output": 100_000})
    try:
        with pytest.raises(OutputTooLarge, match="past the limit"):
            executor.run(spec("flood", "raw"), {}, make_ctx(timeout=20))
        assert executor.run(spec("echo", "raw"), {"a": 1}, make_ctx()) == '{"a": 1}'
    finally:
        executor.close()


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
def test_an_http_answer_that_never_ends_fails_its_call_at_the_cap_and_the_session_serves_on(make_ctx, sse):
    # A JSON body was read whole; an SSE event past the SDK's own 1 MiB read as the server closing.
    server = serve_http(sse)
    url = {"url": f"http://127.0.0.1:{server.server_address[1]}/mcp"}
    executor = mcpexec.McpExecutor({"max_output": 100_000})
    try:
        with pytest.raises(OutputTooLarge, match="byte limit"):
            executor.run(spec("flood", url), {}, make_ctx(timeout=20))
        assert executor.run(spec("echo", url), {"a": 1}, make_ctx()) == '{"a": 1}'
    finally:
        executor.close()
        server.shutdown()


def test_an_sse_answer_larger_than_a_mib_is_read_when_max_output_allows_it(make_ctx):
    server = serve_http(sse=True)
    url = {"url": f"http://127.0.0.1:{server.server_address[1]}/mcp"}
    executor = mcpexec.McpExecutor({"max_output": 4_000_000})
    try:
        text = "y" * 1_500_000
        assert executor.run(spec("echo", url), {"s": text}, make_ctx()) == json.dumps({"s": text})
    finally:
        executor.close()
        server.shutdown()


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
def test_a_gzipped_http_answer_is_held_to_the_cap_as_it_inflates(make_ctx, sse):
    # 200 KB of gzip, 200 MiB inflated: the cap counted the bytes sent, and httpx inflated each read whole.
    import tracemalloc

    server = serve_http(sse, gzip=True)
    url = {"url": f"http://127.0.0.1:{server.server_address[1]}/mcp"}
    executor = mcpexec.McpExecutor({"max_output": 100_000})
    try:
        assert executor.run(spec("echo", url), {"a": 1}, make_ctx()) == '{"a": 1}'  # gzip is read
        tracemalloc.start()
        try:
            with pytest.raises(OutputTooLarge, match="byte limit"):
                executor.run(spec("bomb", url), {}, make_ctx(timeout=30))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, peak
        assert executor.run(spec("echo", url), {"a": 2}, make_ctx()) == '{"a": 2}'
    finally:
        executor.close()
        server.shutdown()
