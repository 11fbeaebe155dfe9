"""What every HTTP route of ``serve`` checks first (``/v1``, ``/mcp``, the console): where the request
comes from and who sends it.

A browser must not be able to drive the API from another site: a foreign ``Origin`` is refused, and
without a token the ``Host`` must be a loopback name (no DNS rebinding). With a token configured
(``--token``/``$HERMES_API_TOKEN`` or ``api.tokens``), a request wants ``Authorization: Bearer <token>``
and is the ``Caller`` its token maps to (``hermes_gateway.credentials``).
"""

from __future__ import annotations

from starlette.requests import HTTPConnection
from starlette.responses import Response

from broker.errors import HermesError
from hermes_gateway.credentials import CALLER_SCOPE_KEY, Caller, Credentials
from hermes_gateway.http_json import reply

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


class Forbidden(HermesError):
    """The request comes from somewhere the API does not serve (a foreign origin or host name)."""

    type = "forbidden"


def check_origin(request: HTTPConnection, token_required: bool) -> None:
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1].rstrip("/") != host:
        raise Forbidden(f"requests from {origin} are not served here (the API serves its own origin only)")
    if not token_required and host.rsplit(":", 1)[0] not in LOOPBACK and host not in LOOPBACK:
        raise Forbidden(f"host {host!r}: without a token the API answers to loopback names only")


def presented_token(request: HTTPConnection, query_token: bool = False) -> str | None:
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:]
    return request.query_params.get("access_token") if query_token else None


def unauthorized() -> Response:
    body = {"type": "unauthorized", "message": "a valid bearer token is required", "details": {}}
    return reply({"error": body}, 401, {"WWW-Authenticate": "Bearer"})


def authenticate(request: HTTPConnection, credentials: Credentials, query_token: bool = False) -> Caller | None:
    """Check the origin (raises Forbidden) and the token: the caller (also kept in the request's scope),
    or None when the token is missing or unknown (answer ``unauthorized()``)."""
    check_origin(request, credentials.required)
    caller = credentials.caller(presented_token(request, query_token))
    if caller is not None:
        request.scope[CALLER_SCOPE_KEY] = caller
    return caller
