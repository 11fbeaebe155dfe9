"""``/mcp`` on ``serve``: ``mcp_serve``'s server on the SDK's streamable HTTP transport. Stateless by
default (any ``serve`` behind a load balancer answers); ``stateful`` keeps handshake-era sessions for
``list_changed`` notices, each in one process and owned by the principal that opened it (to another
principal its id is unknown: 404).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.subscriptions import InMemorySubscriptionBus
from starlette.types import Receive, Scope, Send

from hermes_gateway.credentials import CALLER_SCOPE_KEY, Caller
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
        caller = scope.get(CALLER_SCOPE_KEY)
        if isinstance(caller, Caller):
            scope["user"] = session_owner(caller)
        await self.manager.handle_request(scope, receive, send)


def session_owner(caller: Caller) -> AuthenticatedUser:
    """Who a session belongs to, as the SDK compares it: the principal and admin flag, never the token."""
    who = f"{'admin' if caller.admin else 'principal'}:{caller.principal or ''}"
    return AuthenticatedUser(AccessToken(token="", client_id=who, scopes=[]))
