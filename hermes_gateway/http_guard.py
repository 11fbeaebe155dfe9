"""What every HTTP route of ``serve`` passes through: :class:`Guard` (a foreign ``Origin`` is refused,
without a token the ``Host`` must be a loopback name, else the bearer token names the caller), and
``ERROR_HANDLERS``: a typed error as ``{"error": {"type", "message", "details"}}`` with its status.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import OutOfMemoryError, RedisError
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from broker.connection import out_of_memory
from broker.errors import (
    BrokerFull,
    BrokerNotDurable,
    BrokerUnavailable,
    CallFailed,
    CircuitOpen,
    HermesError,
    IdempotencyConflict,
    InvalidArgs,
    InvalidSpec,
    NoWorkers,
    PermissionDenied,
    QueueFull,
    UnknownBatch,
    UnknownTool,
)
from hermes_gateway.credentials import CALLER_SCOPE_KEY, Caller, Credentials
from hermes_gateway.http_json import BadRequest, RequestTimeout, TooLarge, reply

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


class Forbidden(HermesError):
    """The request comes from somewhere the API does not serve (a foreign origin or host name)."""

    type = "forbidden"


def host_name(host: str) -> str:
    """The name or address of a Host header, without its port (an IPv6 address keeps its brackets)."""
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


def check_origin(request: HTTPConnection, token_required: bool, tokenless: bool = False,
                 allowed: frozenset[str] = frozenset()) -> None:
    """A foreign ``Origin`` is refused; without a token configured the Host must be a loopback name; with
    one, a route that takes no token (``tokenless``) answers only to loopback names, IP addresses and the
    ``allowed`` names: a DNS rebinding page's own name is none of them."""
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1].rstrip("/") != host:
        raise Forbidden(f"requests from {origin} are not served here (the API serves its own origin only)")
    name = host_name(host).lower()
    if not token_required and name not in LOOPBACK and host not in LOOPBACK:
        raise Forbidden(f"host {host!r}: without a token the API answers to loopback names only")
    if token_required and tokenless and name not in LOOPBACK and name not in allowed and not _is_address(name):
        raise Forbidden(
            f"host {host!r}: this route takes no token, so it answers to loopback names, IP addresses and "
            "api.allowed_hosts (HERMES_API_ALLOWED_HOSTS) only"
        )


def presented_token(request: HTTPConnection, query_token: bool = False) -> str | None:
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:]
    return request.query_params.get("access_token") if query_token else None


class Guard:
    """The origin and Host checks (403), then, unless ``token=False``, the bearer token (401, else its
    ``Caller`` in the scope); ``query_token``: ``?access_token=`` too, for ``EventSource``."""

    def __init__(self, app: ASGIApp, creds: Credentials, *, token: bool = True, query_token: bool = False) -> None:
        self.app, self.credentials, self.token, self.query_token = app, creds, token, query_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = HTTPConnection(scope)
        check_origin(request, self.credentials.required, not self.token, self.credentials.allowed_hosts)
        if self.token:
            caller = self.credentials.caller(presented_token(request, self.query_token))
            if caller is None:
                body = {"type": "unauthorized", "message": "a valid bearer token is required"}
                await reply({"error": body}, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
            scope[CALLER_SCOPE_KEY] = caller
        await self.app(scope, receive, send)


def request_caller(request: HTTPConnection) -> Caller:
    """The ``Caller`` that :class:`Guard` kept in the request's scope."""
    return request.scope[CALLER_SCOPE_KEY]


def guarded(credentials: Credentials, *, token: bool = True, query_token: bool = False) -> list[Middleware]:
    """The ``middleware=`` of a route behind :class:`Guard`."""
    return [Middleware(Guard, credentials, token=token, query_token=query_token)]


_STATUS: list[tuple[tuple[type[HermesError], ...], int]] = [
    ((UnknownTool, UnknownBatch), 404),
    ((InvalidSpec, InvalidArgs), 400),
    ((QueueFull,), 429),
    ((IdempotencyConflict,), 409),
    ((PermissionDenied, Forbidden), 403),
    ((CircuitOpen, NoWorkers, BrokerUnavailable, BrokerFull, BrokerNotDurable), 503),
    ((TooLarge,), 413),
    ((RequestTimeout,), 408),
]


def error_reply(error: HermesError) -> Response:
    """A typed error as HTTP: its status (400 unless the table says otherwise) and ``{"error": ...}``."""
    if isinstance(error, CallFailed) and error.type == "unknown_call":
        status = 404
    else:
        status = next((code for cls, code in _STATUS if isinstance(error, cls)), 400)
    return reply({"error": error.to_wire()}, status)


async def _typed(_request: Request, error: Exception) -> Response:
    assert isinstance(error, HermesError)
    return error_reply(error)


async def _broker_down(_request: Request, error: Exception) -> Response:
    if isinstance(error, OutOfMemoryError):
        return error_reply(BrokerFull(out_of_memory(error)))
    return error_reply(BrokerUnavailable(f"the broker did not answer: {error}"))


async def _unsendable(_request: Request, error: Exception) -> Response:  # what msgpack cannot carry
    return error_reply(BadRequest(f"a value cannot be sent: {error}"))


async def _http(request: Request, error: Exception) -> Response:  # Starlette's own: no route, no method
    assert isinstance(error, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
    message, headers = str(error.detail), dict(error.headers or {})
    if error.status_code == 405 and (allowed := _allowed(request)):
        # (Starlette's Allow names the methods of the first route of the path; a path has a route per method)
        headers["Allow"] = allowed
        message = f"{request.method} is not allowed on {request.url.path}; it takes {allowed}"
    return reply({"error": {"type": kind, "message": message}}, error.status_code, headers)


def _allowed(request: Request) -> str:
    """The methods of every route of the request's path, as an ``Allow`` header lists them."""
    methods: set[str] = set()
    for route in getattr(request.app, "routes", ()):
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


async def _crash(_request: Request, _error: Exception) -> Response:  # (uvicorn still logs the traceback)
    message = "the server failed on this request (a bug: its log has the traceback)"
    return reply({"error": {"type": "internal_error", "message": message}}, 500)


# The app's exception handlers (Starlette looks an exception's classes up in order, most derived first);
# every error body is {"error": {"type", "message"[, "details"]}}.
ERROR_HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    500: _crash,
    HTTPException: _http,
    HermesError: _typed,
    RedisError: _broker_down,
    OSError: _broker_down,
    OverflowError: _unsendable,
    UnicodeError: _unsendable,
}
