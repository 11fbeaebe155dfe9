"""AsyncCallHandle: the asyncio client's view of one submitted call (see ``hermes_gateway.aio``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import redis

from broker import events as ev_mod
from broker import keys
from broker.codec import unpack
from broker.errors import CallCancelled, CallTimeout, HermesError, error_from_wire
from broker.events import Event
from broker.states import State
from hermes_gateway.handle import Handles

if TYPE_CHECKING:
    from hermes_gateway.aio import AsyncGateway

_MISSING = object()
_RESYNC = 1.0  # seconds of quiet before a waiter re-reads the durable history (pub/sub may drop)
_POLL = 0.2  # the same for a call whose events go to another client's channel: its history is all we see


class AsyncCallHandle:
    """A submitted call: ``await result()``, ``async for ev in events()``, ``await cancel()``."""

    def __init__(
        self, gateway: AsyncGateway, call_id: str, name: str, kind: str = "tool", *, own: bool = True
    ) -> None:
        self.gateway = gateway
        self.call_id = call_id
        self.name = name
        self.kind = kind
        self.own = own  # False: someone else's call (events are read from its history, not our channel)
        self.refused: HermesError | None = None
        self._events: list[Event] = []
        self._final: Event | None = None
        self._result: Any = _MISSING
        self._signal = asyncio.Event()  # set (and replaced) whenever something new arrives

    def __repr__(self) -> str:
        return f"<AsyncCallHandle {self.name} {self.call_id} {self.state}>"

    @property
    def last_seq(self) -> int:
        return self._events[-1].seq if self._events else 0

    @property
    def state(self) -> str:
        if self.refused is not None:
            return "refused"
        for event in reversed(self._events):
            if event.type == ev_mod.TRANSITION:
                return event.state
        return str(State.PENDING)

    @property
    def final_state(self) -> str | None:
        return self._final.state if self._final else None

    def done(self) -> bool:
        return self._final is not None or self.refused is not None

    def _wake(self) -> None:
        self._signal.set()
        self._signal = asyncio.Event()

    def _feed(self, event: Event) -> None:
        if event.seq <= self.last_seq:
            return
        self._events.append(event)
        if event.terminal:
            self._final = event
            if self.own:  # however the end was seen (pub/sub or a history read), stop tracking the call
                self.gateway._untrack(self)
        self._wake()

    def _refuse(self, error: HermesError) -> None:
        self.refused = error
        self._wake()

    async def sync(self) -> None:
        """Fetch the events we have not seen from the call's durable history."""
        pipe = self.gateway.conn.pipeline(transaction=False)
        pipe.lrange(keys.history(self.call_id), self.last_seq, -1)
        pipe.lindex(keys.history(self.call_id), -1)  # an ended call's history is its terminal event alone
        stored, last = await pipe.execute()
        for event in ev_mod.unseen(stored, last, self.last_seq):
            self._feed(event)

    async def _next_change(self, deadline: float | None) -> None:
        """Wait until something arrives, re-reading the history after a quiet second; CallTimeout at the deadline."""
        signal = self._signal
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise CallTimeout(
                f"no result for call {self.call_id} ({self.name}) in time", call_id=self.call_id
            )
        quiet = _RESYNC if self.own else _POLL
        try:
            await asyncio.wait_for(signal.wait(), quiet if left is None else min(left, quiet))
        except TimeoutError:
            try:
                await self.sync()
            except (redis.ConnectionError, redis.TimeoutError):
                pass  # a broker restart: the call goes on, and so does the wait, until the deadline

    async def result(self, timeout: float | None = None) -> Any:
        """The call's result; raises its typed error, CallCancelled, or CallTimeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            await self._next_change(deadline)
        if self.refused is not None:
            raise self.refused
        final = self._final
        assert final is not None
        if final.state == State.DONE:
            if self._result is _MISSING:
                if "result" in final.detail:
                    self._result = final.detail["result"]
                else:
                    raw = await self.gateway.conn.hget(keys.job(self.call_id), keys.F_RESULT)
                    self._result = unpack(cast(bytes, raw)) if raw is not None else None
            return self._result
        error = final.detail.get("error") or {}
        if final.state == State.CANCELLED:
            raise CallCancelled(error.get("message") or f"call {self.call_id} was cancelled")
        raise error_from_wire(error)

    async def events(self, timeout: float | None = None) -> AsyncIterator[Event]:
        """Every event of the call in order (those already seen first), until the terminal one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        i = 0
        while True:
            while i >= len(self._events):
                if self.refused is not None:
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
