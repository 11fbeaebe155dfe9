"""``hermes-gateway mcp serve``: the directory's tools as an MCP server over stdio.

Any MCP client — the Hermes agent's ``mcp_servers``, an IDE, another agent — sees the tools the principal
may call (the policy the workers judge by) and calls them through the gateway: each call is an ordinary
call (queue, limits, breakers, retries, policy, audit, events and trace), run by the workers. The list is
read from the directory at every ``tools/list``, and a change of the directory (a tool registered, updated
or removed anywhere) is announced with ``notifications/tools/list_changed``, on which clients such as the
Hermes agent list again: an agent sees new tools without a restart.

A failed call comes back as a tool error (``isError``) with its typed error, ``<type>: <message>``; a
result is one text block (a string as it is, anything else as JSON) plus ``structuredContent`` when it is
an object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import mcp_types as types
from mcp.server.lowlevel.server import Server

from broker.errors import HermesError

VERSION = "0.10.0"


def build_server(
    gw: Any,
    *,
    principal: str | None = None,
    session_id: str | None = None,
    timeout: float | None = None,
    sessions: list[Any] | None = None,
) -> Server[Any]:
    """The MCP server for ``gw`` (a ``Gateway``); ``principal`` is who the calls run as. The client's
    session is put in ``sessions`` at its first ``tools/list`` (for ``announce_changes``)."""
    sessions = [] if sessions is None else sessions

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        if not sessions:
            sessions.append(ctx.session)  # the connection to announce changes on
        schemas = await asyncio.to_thread(gw.tool_schemas, principal)
        tools = [
            types.Tool(
                name=f["function"]["name"],
                description=f["function"]["description"] or None,
                input_schema=f["function"]["parameters"],
            )
            for f in schemas
        ]
        return types.ListToolsResult(tools=tools)

    def run(name: str, args: dict[str, Any]) -> Any:
        context = {k: v for k, v in (("principal", principal), ("session_id", session_id)) if v}
        handle = gw.call_tool(name, args, timeout=timeout, **context)
        return handle.result(timeout)

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        try:
            result = await asyncio.to_thread(run, params.name, dict(params.arguments or {}))
        except HermesError as e:
            kind = getattr(e, "error_type", None) or e.type
            return types.CallToolResult(content=[types.TextContent(type="text", text=f"{kind}: {e}")], is_error=True)
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=result if isinstance(result, dict) else None,
        )

    return Server(
        "hermes-gateway",
        version=VERSION,
        instructions="Tools of the Hermes Gateway directory; every call runs on the gateway's workers.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def announce_changes(gw: Any, sessions: list[Any], quiet: float = 0.2) -> None:
    """Send ``notifications/tools/list_changed`` to the client whenever the directory changes (a burst of
    changes within ``quiet`` seconds is one notice). Runs until cancelled."""
    from broker import keys
    from broker.connection import subscriber

    pubsub = subscriber(gw.conn)
    await asyncio.to_thread(pubsub.subscribe, keys.channel(gw.conn, keys.TOOLS_CHANNEL))
    try:
        while True:
            message = await asyncio.to_thread(pubsub.get_message, timeout=1.0)
            if message is None or message.get("type") != "message":
                continue
            await asyncio.sleep(quiet)
            while await asyncio.to_thread(pubsub.get_message, timeout=0.0):
                pass  # the rest of the burst
            if sessions:
                try:
                    await sessions[0].send_tool_list_changed()
                except Exception:  # noqa: BLE001 - the client went away: nothing to tell
                    return
    finally:
        await asyncio.to_thread(pubsub.close)


async def serve_stdio(start: Any, **options: Any) -> None:
    """Serve over stdin/stdout. ``start`` is a context manager yielding ``(gateway, worker processes)``;
    it is entered once the transport owns stdout, so processes it starts cannot write into the protocol."""
    from mcp.server.lowlevel.server import NotificationOptions
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read_stream, write_stream):
        with start() as (gw, _procs):
            gw.sync_tools()
            sessions: list[Any] = []
            server = build_server(gw, sessions=sessions, **options)
            watcher = asyncio.create_task(announce_changes(gw, sessions))
            try:
                init = server.create_initialization_options(NotificationOptions(tools_changed=True))
                await server.run(read_stream, write_stream, init)
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
