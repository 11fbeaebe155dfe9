"""The uvicorn insides hermes_gateway/http_limits.py builds on, one test each, in process: an upgrade of
uvicorn that renames a hook or stops calling it fails here (uvicorn is pinned to the minor versions these
cover). tests/e2e/test_http_limits.py proves the limits themselves against a real ``serve``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from broker.settings import ApiSettings
from hermes_gateway.http_limits import BoundedH11Protocol, uvicorn_options


async def _app(
    scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not check():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


def _serve(header_timeout: float) -> tuple[BoundedH11Protocol, _Transport]:
    options = uvicorn_options(ApiSettings(header_timeout=header_timeout))
    config = uvicorn.Config(_app, lifespan="off", log_level="warning", **options)
    protocol = options["http"](
        config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
    )
    transport = _Transport()
    protocol.connection_made(transport)
    return protocol, transport


def test_the_protocol_class_and_its_hooks_are_where_the_subclass_overrides_them() -> None:
    assert issubclass(BoundedH11Protocol, H11Protocol)
    for hook in ("connection_made", "data_received", "on_response_complete", "connection_lost"):
        assert hook in vars(H11Protocol), hook
    assert list(inspect.signature(H11Protocol.__init__).parameters) == [
        "self",
        "config",
        "server_state",
        "app_state",
        "_loop",
    ]


def test_the_config_takes_a_protocol_class_and_the_bounds_by_these_names() -> None:
    params = inspect.signature(uvicorn.Config.__init__).parameters
    assert {"http", "timeout_keep_alive", "h11_max_incomplete_event_size", "limit_concurrency"} <= set(params)


def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline() -> None:
    """connection_made is called with the transport, and the protocol keeps its loop as ``loop``."""

    async def run() -> None:
        protocol, transport = _serve(0.05)
        assert protocol.transport is transport and protocol.loop is asyncio.get_running_loop()
        assert isinstance(protocol.conn, h11.Connection) and protocol.conn.their_state is h11.IDLE
        await _until(lambda: transport.closed)
        protocol.connection_lost(None)

    asyncio.run(run())


def test_a_complete_head_stops_the_deadline_and_on_response_complete_arms_the_next() -> None:
    async def run() -> None:
        protocol, transport = _serve(0.3)
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert protocol.conn.their_state is not h11.IDLE
        await _until(lambda: b"ok" in transport.out)  # the response went out: on_response_complete ran
        assert not transport.closed
        await _until(lambda: transport.closed)  # kept alive but idle: the next head's deadline passed
        protocol.connection_lost(None)

    asyncio.run(run())


def test_an_answer_before_the_body_is_read_closes_the_connection() -> None:
    async def run() -> None:
        protocol, transport = _serve(30)
        protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab")
        await _until(lambda: b"ok" in transport.out)
        await _until(lambda: transport.closed)  # the client still owed 98 bytes: never wait on them
        protocol.connection_lost(None)

    asyncio.run(run())
