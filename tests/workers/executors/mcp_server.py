"""A real MCP server for the executor tests: ``python mcp_server.py stdio`` or ``... http PORT``."""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("hermes-test")


@server.tool()
def greet(name: str) -> str:
    """Greet someone by name."""
    return f"Hello, {name}!"


@server.tool()
def add(a: int, b: int) -> dict:
    """Add two integers."""
    return {"sum": a + b}


@server.tool()
def fail(message: str) -> str:
    """Always fails with the given message."""
    raise ToolError(message)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "done"


@server.tool()
def big(size: int) -> str:
    """Return a string of the given size."""
    return "x" * size


@server.tool()
def whoami() -> dict:
    """The server's process id (to see a new session after a restart)."""
    return {"pid": os.getpid()}


@server.tool()
def die() -> str:
    """Exit the server process at once."""
    os._exit(3)


@server.tool(name="files.read")
def files_read(path: str) -> str:
    """A name with a dot, as some servers use: not a name model APIs accept for a function."""
    return f"read {path}"


@server.tool()
async def trace(ctx: Context) -> dict:
    """Return the trace context the request carried in ``_meta`` and report progress."""
    await ctx.report_progress(1, 2, "half way")
    meta = ctx.request_context.meta or {}
    out = {"traceparent": meta.get("traceparent"), "tracestate": meta.get("tracestate")}
    if "baggage" in meta:
        out["baggage"] = meta["baggage"]
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        if len(sys.argv) > 1 and sys.argv[1] == "slowstart":
            import time

            time.sleep(float(sys.argv[2]))
        server.run("stdio")
