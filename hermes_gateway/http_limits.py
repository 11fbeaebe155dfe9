"""Bounded HTTP for ``serve``: every connection either makes progress or is closed.

uvicorn (h11) closes a connection idle *after* a response (``timeout_keep_alive``) but waits forever for
a request that never comes or trickles in byte by byte, and every byte it receives cancels that timer.
So ``serve`` runs uvicorn with :class:`BoundedH11Protocol`, which adds:

- a **header deadline**: the request line and headers must be complete within ``header_timeout`` of the
  connection opening (or of the previous response ending, on a kept-alive connection); otherwise the
  connection is closed. It covers idle connections that never send a request, and slow-header ones;
- **no half-read bodies**: a response sent while the client is still sending its body (413, 408, a route
  that reads none) closes the connection, instead of leaving it open to a trickle.

The body itself has a deadline in :func:`hermes_gateway.http_json.read_body` (``body_timeout``: 408).
Headers are capped at ``MAX_HEADER_BYTES`` (h11's incomplete-event limit: more is a 400), and at most
``max_connections`` connections are served at once (uvicorn's ``limit_concurrency``: 503 past it; an SSE
stream holds one). Each has an environment variable (``settings.api``: broker/settings.py), read when
``serve`` starts.

uvicorn's public settings cannot do the header deadline (its keep-alive timer starts only after a first
response, and any byte stops it), so this subclasses its ``H11Protocol``: the hooks and attributes used
(``connection_made``, ``data_received``, ``on_response_complete``, ``connection_lost``, ``conn``,
``loop``, ``transport``) are checked one by one in tests/gateway/test_uvicorn_internals.py, and uvicorn is
pinned to the minor versions they cover.
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

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

    def _close(self) -> None:
        # (uvicorn's keep-alive timer needs no cancelling here: connection_lost cancels it, and it does
        # nothing on a closing transport)
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
