"""The directory's tools as an MCP server, for stdio (``mcp serve``) and ``/mcp`` (``mcp_http``): a client
sees the tools its principal may call, each call an ordinary gateway call on the workers (a ``_meta``
``traceparent`` continues the caller's trace; a cancelled or abandoned call is cancelled). Directory
changes are announced (``list_changed`` to handshake-era sessions, ``subscriptions/listen`` streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import mcp_types as types
import structlog
from mcp.server.lowlevel.server import NotificationOptions, Server

from broker import events as ev_mod
from broker.errors import HermesError, InvalidArgs, UnknownTool
from hermes_gateway import __version__
from hermes_gateway.credentials import CALLER_SCOPE_KEY, Caller
from hermes_gateway.http_json import dumps

MAX_SESSIONS = 10_000  # handshake-era sessions remembered for list_changed (the SDK's default session cap)

log = structlog.get_logger("hermes.mcp")


class _Server(Server[Any]):
    """The SDK's low-level server, announcing ``tools.listChanged`` to handshake-era clients on every
    transport (the HTTP session manager builds its initialization options without arguments)."""

    def create_initialization_options(self, notification_options: Any = None, *args: Any, **kwargs: Any) -> Any:
        options = notification_options or NotificationOptions(tools_changed=True)
        return super().create_initialization_options(options, *args, **kwargs)


class Sessions(OrderedDict[str, Any]):
    """Handshake-era sessions that listed tools, to tell of a change (the oldest forgotten past a cap)."""

    def add(self, key: str, session: Any) -> None:
        self[key] = session
        self.move_to_end(key)
        while len(self) > MAX_SESSIONS:
            self.popitem(last=False)


def _session_key(ctx: Any) -> str | None:
    """The key a session is remembered by: its ``Mcp-Session-Id`` over HTTP, ``stdio`` on stdio; None for
    a stateless HTTP request or a 2026-era one (no stream to push on: those clients listen instead)."""
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
        return None
    if ctx.request is None:
        return "stdio"
    return ctx.request.headers.get("mcp-session-id")


def build_server(
    gw: Any,
    agw: Callable[[], Any],
    *,
    principal: str | None = None,
    session_id: str | None = None,
    timeout: float | None = None,
    sessions: Sessions,
    bus: Any,
    need_workers: bool = False,
) -> Server[Any]:
    """The MCP server over ``gw`` (directory, policy) and ``agw()`` (the ``AsyncGateway`` calls go through).
    ``principal``: who calls run as when the request has no caller (stdio). ``sessions``/``bus``: where
    ``ChangeNotices`` finds handshake-era sessions and listen streams. ``need_workers``: a call to a queue
    no live worker serves is refused at once (``no_workers``)."""
    from mcp.server.subscriptions import ListenHandler

    fixed = Caller(principal)

    def caller_of(ctx: Any) -> Caller:
        found = ctx.request.scope.get(CALLER_SCOPE_KEY) if ctx.request is not None else None
        return found if isinstance(found, Caller) else fixed

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        key = _session_key(ctx)
        if key is not None:
            sessions.add(key, ctx.session)  # the connection to announce changes on
        schemas = await anyio.to_thread.run_sync(gw.tool_schemas, caller_of(ctx).principal)
        tools = [
            types.Tool(
                name=f["function"]["name"],
                description=f["function"]["description"] or None,
                input_schema=f["function"]["parameters"],
            )
            for f in schemas
        ]
        return types.ListToolsResult(tools=tools)

    def judged(name: str, principal: str | None) -> tuple[Any, bool]:
        """The tool's spec (None: not in the directory) and whether ``principal`` may call it."""
        try:
            spec = gw.tool(name).spec
        except UnknownTool:
            return None, False
        return spec, gw.policy().check(principal, spec).allowed

    async def run(ctx: Any, name: str, args: dict[str, Any]) -> Any:
        meta = dict(ctx.meta or {})
        principal = caller_of(ctx).principal
        context = {k: v for k, v in (("principal", principal), ("session_id", session_id)) if v}
        spec, allowed = await anyio.to_thread.run_sync(judged, name, principal)  # (the worker judges the args)
        if not allowed:  # one answer for a tool it may not call and one that does not exist (not listed: unknown)
            if spec is not None:  # sent all the same, unwaited: the worker refuses it and audits the refusal
                with contextlib.suppress(HermesError):
                    await agw().call_tool(name, args, timeout=timeout, **context)
            raise UnknownTool(f"unknown tool {name!r}: not one of the tools listed to this client", tool=name)
        if need_workers:
            await anyio.to_thread.run_sync(gw.require_workers, str(spec.config.get("queue") or "tools"))
        trace = {name: _text(meta.get(name)) for name in ("traceparent", "tracestate")}
        handle = await agw().call_tool(name, args, timeout=timeout, **trace, **context)
        try:
            token = meta.get("progress_token", meta.get("progressToken"))
            if token is not None:
                await _progress(ctx, handle, token, timeout)
            return await handle.result(timeout)
        except BaseException:  # cancelled by the client (or it went away): cancel the call on the queue
            if not handle.done():
                with anyio.CancelScope(shield=True):
                    await handle.cancel()
            raise

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        try:
            result = await run(ctx, params.name, _strict(dict(params.arguments or {})))
        except HermesError as e:
            kind = getattr(e, "error_type", None) or e.type
            return types.CallToolResult(content=[types.TextContent(type="text", text=f"{kind}: {e}")], is_error=True)
        text = result if isinstance(result, str) else dumps(result)  # (strict JSON, as the HTTP API answers)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=result if isinstance(result, dict) else None,
        )

    return _Server(
        "hermes-gateway",
        version=__version__,
        instructions="Tools of the Hermes Gateway directory; every call runs on the gateway's workers.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_subscriptions_listen=ListenHandler(bus),
    )


def _strict(args: dict[str, Any]) -> dict[str, Any]:
    """``args``, refused when they hold NaN or Infinity (the SDK reads them; JSON, and the HTTP API, do not)."""
    try:
        json.dumps(args, allow_nan=False)
    except ValueError as e:
        raise InvalidArgs("arguments hold NaN or Infinity, which JSON has no number for") from e
    return args


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


async def _progress(ctx: Any, handle: Any, token: Any, timeout: float | None) -> None:
    """The call's progress events as ``notifications/progress`` (1, 2, ... with their message)."""
    count = 0
    async for event in handle.events(timeout):
        if event.type != ev_mod.PROGRESS:
            continue
        count += 1
        message = event.detail.get("message")
        await ctx.session.send_progress_notification(
            token, float(count), None, str(message) if message is not None else None, related_request_id=ctx.request_id
        )


class ChangeNotices:
    """A thread on the directory's change channel that tells ``bus`` and ``sessions`` the tool list changed
    (a burst within ``quiet`` seconds is one notice); after a Redis error it subscribes again, backing off."""

    def __init__(
        self, gw: Any, sessions: Sessions, bus: Any, loop: asyncio.AbstractEventLoop, quiet: float = 0.2
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
                asyncio.run_coroutine_threadsafe(self._announce(), self.loop)
        finally:
            pubsub.close()

    async def _announce(self) -> None:
        from mcp.server.subscriptions import ToolsListChanged

        await self.bus.publish(ToolsListChanged())  # the 2026 protocol's listen streams

        async def tell(key: str, session: Any) -> None:  # the handshake era's notification
            try:
                with anyio.fail_after(5):
                    await session.send_tool_list_changed()
            except Exception:  # noqa: BLE001 - the client went away or is stuck: forget it
                self.sessions.pop(key, None)

        async with anyio.create_task_group() as group:  # side by side: a stuck client holds up no other
            for key, session in list(self.sessions.items()):
                group.start_soon(tell, key, session)


async def answer_unreadable(source: Any, sink: Any, replies: Any) -> None:
    """Pass the client's messages on; answer a line that is no JSON-RPC message (the SDK's stdio reader
    hands it over as an exception, which the server drops: the client would wait for ever) with a parse
    error or an invalid request, under the line's id when Python's more lenient json reads one (a lone
    surrogate escape, which pydantic refuses), else null as JSON-RPC says."""
    from mcp.shared.message import SessionMessage

    async with sink:
        async for item in source:
            if not isinstance(item, Exception):
                await sink.send(item)
                continue
            problems = item.errors() if hasattr(item, "errors") else []
            line = problems[0].get("input") if problems else None
            try:
                body = json.loads(line) if isinstance(line, str) else None
            except ValueError:
                body = None
            request_id = body["id"] if isinstance(body, dict) and type(body.get("id")) in (int, str) else None
            if any(p.get("type") == "json_invalid" for p in problems):
                error = types.ErrorData(code=types.PARSE_ERROR, message="unreadable JSON (RFC 8259, UTF-8, no lone surrogates)")
            else:
                error = types.ErrorData(code=types.INVALID_REQUEST, message="not a JSON-RPC message")
            await replies.send(SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)))


async def serve_stdio(gw: Any, **options: Any) -> None:
    """Serve ``gw``'s directory over stdin/stdout until the client closes stdin."""
    from mcp.server.stdio import stdio_server
    from mcp.server.subscriptions import InMemorySubscriptionBus

    from broker.connection import async_from_url
    from hermes_gateway.aio import AsyncGateway

    sessions = Sessions()
    bus = InMemorySubscriptionBus()
    agw = AsyncGateway(await async_from_url(gw.broker.url), gw.settings)
    await agw.start()
    server = build_server(gw, lambda: agw, sessions=sessions, bus=bus, **options)
    notices = ChangeNotices(gw, sessions, bus, asyncio.get_running_loop()).start()
    try:
        async with stdio_server() as (read_stream, write_stream):
            sink, inbox = anyio.create_memory_object_stream[Any](0)
            async with anyio.create_task_group() as group:
                group.start_soon(answer_unreadable, read_stream, sink, write_stream)
                await server.run(inbox, write_stream, server.create_initialization_options())
    finally:
        notices.stop()
        await agw.close()
