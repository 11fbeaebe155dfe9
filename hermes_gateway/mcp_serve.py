"""``hermes-gateway mcp serve``: the directory's tools as an MCP server over stdio.

Any MCP client — the Hermes agent's ``mcp_servers``, an IDE, another agent — sees the tools the principal
may call (the policy the workers judge by) and calls them through the gateway: each call is an ordinary
call (queue, limits, breakers, retries, policy, audit, events and trace), run by the workers. The list is
read from the directory at every ``tools/list``. A change of the directory (a tool registered, updated or
removed anywhere) is announced, so clients list again and an agent sees new tools without a restart: with
``notifications/tools/list_changed`` in the handshake-era protocol (the Hermes agent's mcp 1.x client),
and on ``subscriptions/listen`` streams in the newer one.

A failed call comes back as a tool error (``isError``) with its typed error, ``<type>: <message>``; a
result is one text block (a string as it is, anything else as JSON) plus ``structuredContent`` when it is
an object. A call the client cancels (or abandons by leaving) is cancelled in the gateway too.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mcp_types as types
import structlog
from mcp.server.lowlevel.server import Server

from broker.errors import HermesError

VERSION = "0.10.0"
CALL_THREADS = 64  # tool calls awaited at once (each waits on a thread of its own)

log = structlog.get_logger("hermes.mcp")


def build_server(
    gw: Any,
    *,
    principal: str | None = None,
    session_id: str | None = None,
    timeout: float | None = None,
    sessions: list[Any] | None = None,
    pool: ThreadPoolExecutor | None = None,
    need_workers: bool = False,
    bus: Any = None,
) -> Server[Any]:
    """The MCP server for ``gw`` (a ``Gateway``); ``principal`` is who the calls run as. The client's
    session is put in ``sessions`` at its first ``tools/list`` (for ``ChangeNotices``). ``need_workers``:
    a call to a queue no live worker serves is refused at once (``no_workers``) instead of waiting.
    ``bus``: the ``SubscriptionBus`` that ``subscriptions/listen`` streams are served from."""
    from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler

    sessions = [] if sessions is None else sessions
    threads = pool or ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="hermes-mcp-call")

    async def blocking(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(threads, fn, *args)

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        if not sessions:
            sessions.append(ctx.session)  # the connection to announce changes on
        schemas = await blocking(gw.tool_schemas, principal)
        tools = [
            types.Tool(
                name=f["function"]["name"],
                description=f["function"]["description"] or None,
                input_schema=f["function"]["parameters"],
            )
            for f in schemas
        ]
        return types.ListToolsResult(tools=tools)

    def submit(name: str, args: dict[str, Any]) -> Any:
        if need_workers:
            gw.require_workers(str(gw.tool(name).spec.config.get("queue") or "tools"))
        context = {k: v for k, v in (("principal", principal), ("session_id", session_id)) if v}
        return gw.call_tool(name, args, timeout=timeout, **context)

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        try:
            handle = await blocking(submit, params.name, dict(params.arguments or {}))
            try:
                result = await blocking(handle.result, timeout)
            except asyncio.CancelledError:  # the client cancelled the request, or went away
                handle.cancel()
                raise
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
        on_subscriptions_listen=ListenHandler(bus if bus is not None else InMemorySubscriptionBus()),
    )


class ChangeNotices:
    """A thread on the directory's change channel that sends ``notifications/tools/list_changed`` to the
    client's session (a burst of changes within ``quiet`` seconds is one notice). Redis errors are logged
    and the subscription is made again, backing off up to 5 s."""

    def __init__(
        self, gw: Any, sessions: list[Any], bus: Any, loop: asyncio.AbstractEventLoop, quiet: float = 0.2
    ) -> None:
        self.gw, self.sessions, self.bus, self.loop, self.quiet = gw, sessions, bus, loop, quiet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hermes-mcp-changes", daemon=True)

    def start(self) -> ChangeNotices:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                self._listen()
                return
            except Exception as e:  # noqa: BLE001 - a broker hiccup must not end the notices for good
                log.warning("directory change notices interrupted; subscribing again", error=str(e))
                self._stop.wait(backoff)
                backoff = min(5.0, backoff * 2)

    def _listen(self) -> None:
        from broker import keys
        from broker.connection import subscriber

        pubsub = subscriber(self.gw.conn)
        try:
            pubsub.subscribe(keys.channel(self.gw.conn, keys.TOOLS_CHANNEL))
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=0.5)
                if message is None or message.get("type") != "message":
                    continue
                until = time.monotonic() + self.quiet
                while time.monotonic() < until and not self._stop.is_set():
                    pubsub.get_message(timeout=max(0.0, until - time.monotonic()))  # the rest of the burst
                self._announce()
        finally:
            pubsub.close()

    def _announce(self) -> None:
        from mcp.server.subscriptions import ToolsListChanged

        notices = [self.bus.publish(ToolsListChanged())]  # the newer era's listen streams
        if self.sessions:  # the handshake era's notification (dropped by the SDK on a newer-era session)
            notices.append(self.sessions[0].send_tool_list_changed())
        for coroutine in notices:
            notice = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
            try:
                notice.result(5)
            except Exception:  # noqa: BLE001 - the client went away or is stuck: nothing to tell
                pass


async def serve_stdio(gw: Any, **options: Any) -> None:
    """Serve ``gw``'s directory over stdin/stdout until the client closes stdin."""
    from mcp.server.lowlevel.server import NotificationOptions
    from mcp.server.stdio import stdio_server
    from mcp.server.subscriptions import InMemorySubscriptionBus

    sessions: list[Any] = []
    bus = InMemorySubscriptionBus()
    pool = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="hermes-mcp-call")
    server = build_server(gw, sessions=sessions, pool=pool, bus=bus, **options)
    notices = ChangeNotices(gw, sessions, bus, asyncio.get_running_loop()).start()
    try:
        async with stdio_server() as (read_stream, write_stream):
            init = server.create_initialization_options(NotificationOptions(tools_changed=True))
            await server.run(read_stream, write_stream, init)
    finally:
        notices.stop()
        pool.shutdown(wait=False, cancel_futures=True)
