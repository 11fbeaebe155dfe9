"""A blocking HTTP exchange on a helper thread, so the calling thread can be cancelled or time out at once.

httpx cannot resume a response after a read timeout, and closing a socket does not wake a thread blocked
in ``recv``: the reader hands items over a queue the caller polls; on abort the socket is shut down
(which wakes the reader) and the reader closes the response itself.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

from broker.errors import CallCancelled, ProviderTimeout

from .provider import ProviderContext

POLL = 0.25  # seconds between cancellation checks while waiting for the server

Item = tuple[str, Any]

# Items after which the reader hands over nothing more (it may still drain the body for reuse).
FINAL = frozenset({"error", "json", "end"})


class Exchange:
    """The hand-over between the reader thread and the calling thread for one provider call."""

    def __init__(self, ctx: ProviderContext) -> None:
        self.ctx = ctx
        self.stop = threading.Event()
        self.final = False
        self._items: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._sock: socket.socket | None = None  # set once by the reader, read by abort (one reference)

    def start(self, target: Callable[[Exchange], None]) -> None:
        """Run ``target(self)`` on a daemon thread named after the call."""
        threading.Thread(target=target, args=(self,), daemon=True, name=f"llm-{self.ctx.call_id}").start()

    def put(self, kind: str, value: Any = None) -> None:
        """Hand one item to the caller."""
        self._items.put((kind, value))

    def attach(self, response: Any) -> None:
        """Remember the response's socket so an abort can wake a reader blocked on it."""
        stream = (getattr(response, "extensions", None) or {}).get("network_stream")
        self._sock = stream.get_extra_info("socket") if stream is not None else None
        if self.stop.is_set():
            self._shutdown()

    def next(self) -> Item:
        """The next item from the reader; raises CallCancelled or ProviderTimeout (and aborts) instead."""
        ctx = self.ctx
        while True:
            try:
                ctx.check()
                left = ctx.remaining()
            except (CallCancelled, ProviderTimeout):
                self.abort()
                raise
            try:
                item = self._items.get(timeout=min(POLL, left))
            except queue.Empty:
                continue
            self.final = item[0] in FINAL
            return item

    def abort(self) -> None:
        """Tell the reader to stop and wake it if it is blocked on the socket (unless it is done)."""
        if self.final:
            return
        self.stop.set()
        self._shutdown()

    def _shutdown(self) -> None:
        if (sock := self._sock) is None:
            return
        # The base-class method: an SSLSocket is shut down at the TCP level, its TLS state untouched.
        with contextlib.suppress(OSError):  # already closed
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
