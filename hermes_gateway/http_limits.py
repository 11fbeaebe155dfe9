"""Bounded HTTP for ``serve``: uvicorn (h11) waits forever for a request head that trickles in, so
:class:`BoundedH11Protocol` closes a connection whose head is not in within ``header_timeout`` (of
opening, or of the previous response), or that is still sending a body already answered. No public
uvicorn setting does this: the hooks used are checked in tests/gateway/test_uvicorn_internals.py, and
uvicorn is pinned to the versions they cover.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from broker.config import ApiSettings

MAX_HEADER_BYTES = 64 * 1024


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, closing connections left with a half-read body."""

    header_timeout = ApiSettings.header_timeout  # (uvicorn_options makes a subclass with the one asked for)
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_deadline is not None and self.conn.their_state is not h11.IDLE:
            self._disarm()  # the request head is in: the app (and read_body's deadline) take over

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:
            # Answered before the body was read (413, 408, ...): never wait on the rest of it.
            self._close()
        elif self.conn.their_state is h11.IDLE:
            self._arm()  # the next request's head has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.header_timeout, self._head_late)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE:  # no complete request head in time
            self._close()

    def _close(self) -> None:  # (uvicorn's keep-alive timer: connection_lost cancels it)
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(api: ApiSettings) -> dict[str, Any]:
    """The ``uvicorn.Config`` keyword arguments that bound ``serve``'s connections."""
    protocol = type("BoundedH11Protocol", (BoundedH11Protocol,), {"header_timeout": api.header_timeout})
    return {
        "http": protocol,
        "timeout_keep_alive": api.keep_alive,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "limit_concurrency": api.max_connections,
    }
