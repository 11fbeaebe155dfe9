"""Strict JSON in and out of the HTTP API. Request bodies are ``application/json``, bounded in size
(``HERMES_API_MAX_BODY``: 413) and arrival time (``HERMES_API_BODY_TIMEOUT``: 408), without ``NaN`` or
``Infinity``; responses and SSE events write a non-finite number as ``null``, bytes as ``{"$base64": ...}``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from broker.config import API_BODY_TIMEOUT_ENV, API_MAX_BODY_ENV, ApiSettings
from broker.errors import HermesError


class BadRequest(HermesError):
    """The request itself is malformed (not JSON, wrong field types)."""

    type = "bad_request"


class TooLarge(HermesError):
    """The request body is larger than the API accepts."""

    type = "payload_too_large"


class RequestTimeout(HermesError):
    """The request body did not arrive in time."""

    type = "request_timeout"


def _plain(value: Any) -> Any:
    """JSON for what a tool may return beyond JSON's types (msgpack bytes become base64)."""
    if isinstance(value, bytes | bytearray):
        return {"$base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity as None (only called when there is one)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {(_finite(k) if isinstance(k, float) else k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_finite(v) for v in value]
    return value


def dumps(data: Any, ascii_only: bool = False) -> str:
    """Strict JSON text of ``data``."""
    try:
        return json.dumps(data, ensure_ascii=ascii_only, default=_plain, allow_nan=False)
    except ValueError:  # a NaN or infinity somewhere: JSON has no such number
        return json.dumps(_finite(data), ensure_ascii=ascii_only, default=_plain, allow_nan=False)


def reply(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    try:
        body = dumps(data).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate the caller sent comes back escaped, not as a 500
        body = dumps(data, ascii_only=True).encode("ascii")
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-lines")


async def read_raw(request: Request, api: ApiSettings, types: tuple[str, ...] = ("application/json",)) -> bytes:
    """The request's body bytes, sent as one of ``types`` and bounded by ``api``'s size and time."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() not in types:
        raise BadRequest(f"the request body must be sent as Content-Type: {' or '.join(types)}")
    limit = api.max_body
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body is {int(declared)} bytes, over the limit of {limit} ({API_MAX_BODY_ENV})")
    raw = bytearray()
    deadline = api.body_timeout
    try:
        async with asyncio.timeout(deadline):  # a slow (or stalled) body is not waited on forever
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    raise TooLarge(f"the request body is over the limit of {limit} bytes ({API_MAX_BODY_ENV})")
    except TimeoutError as e:
        raise RequestTimeout(
            f"the request body did not arrive within {deadline:g}s ({len(raw)} bytes came; {API_BODY_TIMEOUT_ENV})"
        ) from e
    return bytes(raw)


def _float(text: str) -> float:
    """A JSON number as a float, refused when it is past a float's range (``1e400`` would be infinity)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a JSON number a float can hold")
    return value


def parse_json(raw: bytes, what: str = "the request body") -> Any:
    """Strict JSON (no NaN or Infinity), or a typed error."""
    try:
        return json.loads(raw, parse_constant=_not_json, parse_float=_float)
    except ValueError as e:
        raise BadRequest(f"{what} is not JSON: {e}") from e
    except RecursionError as e:  # (arrays or objects nested thousands deep)
        raise BadRequest(f"{what} is nested too deeply") from e


async def read_body(request: Request, api: ApiSettings) -> dict[str, Any]:
    """The request's JSON object (strictly JSON, bounded by ``api``'s size and time), or a typed error."""
    data = parse_json(await read_raw(request, api))
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(data).__name__}")
    return data
