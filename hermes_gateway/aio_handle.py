"""AsyncCallHandle: the asyncio client's view of one submitted call (its state lives in ``clientcore.CallState``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import redis

from broker import events as ev_mod
from broker.errors import CallTimeout
from broker.events import Event
from hermes_gateway.clientcore import LIVE_GRACE, CallState, Handles, Router, await_steps

if TYPE_CHECKING:
    from hermes_gateway.aio import AsyncGateway

_RESYNC = 1.0  # seconds of quiet before a waiter re-reads the durable history (pub/sub may drop)
_POLL = 0.2  # the same for a call whose events go to another client's channel: its history is all we see


class AsyncCallHandle(CallState):
    """A submitted call: ``await result()``, ``async for ev in events()``, ``await cancel()``."""

    def __init__(self, gateway: AsyncGateway, call_id: str, name: str, kind: str = "tool", *,
                 own: bool = True) -> None:
        super().__init__(gateway.router, call_id, name, kind, own=own)
        self.gateway = gateway
        self._signal = asyncio.Event()  # set (and replaced) whenever something new arrives
        self.followers = 0  # events() following it, when it is another client's call (``AsyncGateway.following``)

    @property
    def heard(self) -> bool:
        """Whether its events come live: ours, or another client's call being followed."""
        return self.own or self.followers > 0

    def _changed(self, event: Event | None) -> None:
        self._signal.set()
        self._signal = asyncio.Event()

    async def sync(self, live_grace: float = 0.0) -> None:
        """Fetch the events we have not seen from the call's durable history (``live_grace``: as
        ``CallHandle.sync``)."""
        pipe = self.gateway.conn.pipeline(transaction=False)
        Router.read_history(pipe, [self])
        seen = self.last_seq
        stored, end = await pipe.execute()
        history = ev_mod.unseen(stored, end, seen, self.call_id)
        if live_grace > 0 and self.heard and ev_mod.ends_past_a_gap(history, seen):
            deadline = time.monotonic() + live_grace
            while not self.done() and (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(self._signal.wait(), left)
                except TimeoutError:
                    break
        for event in history:
            self.feed(event)

    async def _next_change(self, deadline: float | None) -> None:
        """Wait for news, re-reading the history after a quiet while; CallTimeout at the deadline."""
        signal = self._signal
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise CallTimeout(f"no result for call {self.call_id} ({self.name}) in time",
                              call_id=self.call_id)
        quiet = _RESYNC if self.heard else _POLL
        try:
            await asyncio.wait_for(signal.wait(), quiet if left is None else min(left, quiet))
        except TimeoutError:
            # (a broker restart: the call goes on, and so does the wait, until the deadline)
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                await self.sync(LIVE_GRACE)

    async def result(self, timeout: float | None = None) -> Any:
        """The call's result; raises its typed error, CallCancelled, or CallTimeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.settled():
            await self._next_change(deadline)
        return await await_steps(self._outcome(self.gateway.conn))

    async def events(self, timeout: float | None = None) -> AsyncIterator[Event]:
        """Every event of the call in order (those already seen first), until the terminal one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        i = 0
        async with self.gateway.following(self):
            while True:
                while i >= len(self._events):
                    if self.refused is not None or self.abandoned is not None:
                        return
                    try:
                        await self._next_change(deadline)
                    except CallTimeout:
                        return
                event = self._events[i]
                i += 1
                yield event
                if event.terminal:
                    return

    async def cancel(self) -> bool:
        """Ask for the call to stop: at once while it waits, through its worker while it runs."""
        return await self.gateway.cancel(self.call_id)


class AsyncBatch(Handles[AsyncCallHandle]):
    """A batch's ``AsyncCallHandle``s (``AsyncGateway.map`` / ``submit_many``)."""
