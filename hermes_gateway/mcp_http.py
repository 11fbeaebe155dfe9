"""``/mcp`` on ``hermes-gateway serve``: the MCP server of ``hermes_gateway.mcp_serve`` on the streamable
HTTP transport (the ``mcp`` SDK's ``StreamableHTTPSessionManager``), behind the API's protections (its
route's ``http_guard.Guard``: origin, Host, bearer token).

Stateless by default: every request stands alone, so any ``serve`` behind a load balancer answers any
request; 2026-protocol clients get tool-list changes on a ``subscriptions/listen`` stream. ``stateful``
(``serve --mcp-stateful``) keeps handshake-era sessions (``Mcp-Session-Id``) with their GET stream, so
``notifications/tools/list_changed`` reaches clients such as the Hermes agent's mcp 1.x client — a
session lives in one ``serve`` process, so a proxy in front of several must keep a client on one
(sticky on the ``Mcp-Session-Id`` header).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.subscriptions import InMemorySubscriptionBus
from starlette.types import Receive, Scope, Send

from hermes_gateway.mcp_serve import ChangeNotices, Sessions, build_server


class McpEndpoint:
    """The ASGI app served at ``/mcp``; ``running()`` is entered in the server's lifespan."""

    def __init__(self, gw: Any, agw: Callable[[], Any], *, stateful: bool = False) -> None:
        self.gw = gw
        self.sessions = Sessions()
        self.bus = InMemorySubscriptionBus()
        server = build_server(gw, agw, sessions=self.sessions, bus=self.bus)
        self.manager = StreamableHTTPSessionManager(
            server, stateless=not stateful, max_request_body_size=gw.settings.api.max_body, session_idle_timeout=30 * 60
        )

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        notices = ChangeNotices(self.gw, self.sessions, self.bus, asyncio.get_running_loop()).start()
        try:
            async with self.manager.run():
                yield
        finally:
            notices.stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.manager.handle_request(scope, receive, send)
