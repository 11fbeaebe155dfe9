"""The MCP SDK insides workers/executors/mcp_session.py reads (``Session.alive``: the SDK has no public
"the server's stream ended" flag; its stdio transport stops a server the SDK's way), one test each: an upgrade that renames one fails here rather than
leaving the executor reusing a dead session. mcp is pinned (pyproject.toml) to the minor version these
cover."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import signal
from typing import Any

from mcp import Client
from mcp.client.session import ClientSession
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher

from workers.executors.mcp_session import SessionPool

from .test_mcp import STDIO, wait_gone


def test_a_client_keeps_its_session_as_underscore_session() -> None:
    assert "_session" in {f.name for f in dataclasses.fields(Client)}


def test_a_client_session_keeps_its_dispatcher_as_underscore_dispatcher() -> None:
    assert "self._dispatcher" in inspect.getsource(ClientSession.__init__)


def test_a_dispatcher_says_closed_once_its_stream_ends() -> None:
    source = inspect.getsource(JSONRPCDispatcher)
    assert "self._closed = False" in inspect.getsource(JSONRPCDispatcher.__init__)
    assert "self._closed = True" in inspect.getsource(JSONRPCDispatcher.run) and source


def test_the_stdio_transport_still_has_the_server_shutdown_the_executor_reuses() -> None:
    from mcp.client import stdio

    assert list(inspect.signature(stdio._stop_server_process).parameters) == ["process"]


def test_a_session_whose_server_died_is_no_longer_alive(wait_until: Any) -> None:
    pool = SessionPool()
    try:
        session = pool.submit(pool.get("test", STDIO, 10, 10**6)).result(15)
        assert session.alive
        reply = pool.submit(session.client.call_tool("whoami", {})).result(15)
        pid = json.loads(reply.content[0].text)["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_gone(pid)
        wait_until(lambda: not session.alive, timeout=10)
    finally:
        pool.close()


def test_a_malformed_result_is_said_as_such_not_as_a_server_that_did_not_start() -> None:
    from mcp.types import CallToolResult
    from pydantic import ValidationError

    from workers.executors.mcp_session import translate

    try:
        CallToolResult.model_validate({"content": "notalist"})
    except ValidationError as e:
        error = translate(e, "tool 'm'", 10.0, {"command": ["srv"]})
    assert "sent a malformed result" in str(error) and "cannot start" not in str(error)
