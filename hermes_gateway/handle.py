"""CallHandle: the threaded client's view of one submitted call (its state lives in ``clientcore.CallState``)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import redis

from broker import events as ev_mod
from broker.errors import BrokerUnavailable, CallTimeout, HermesError
from broker.events import Event
from hermes_gateway.clientcore import LIVE_GRACE, CallState, Handles, run_steps

if TYPE_CHECKING:
    from hermes_gateway.client import Gateway


class CallHandle(CallState):
    """A submitted call: wait for its result, follow its events, or cancel it."""

    def __init__(self, gateway: Gateway, call_id: str, name: str, kind: str = "tool", *, own: bool = True) -> None:
        # A plain lock guards the state (never re-entered); the condition on it for new events and for the
        # end is made by the first thread that waits: most handles of a batch are done before anyone
        # waits on them, and a Condition costs more to build than the rest of a handle.
        self._mutex = threading.Lock()
        self._waiting: threading.Condition | None = None
        super().__init__(gateway.router, call_id, name, kind, own=own, lock=self._mutex)
        self.gateway = gateway
        self._followers = 0  # threads waiting in events() for the next event (result() waits for the end)

    @property
    def _cv(self) -> threading.Condition:
        if self._waiting is None:
            with self._mutex:  # (made and looked at under the lock: _changed never misses a waiter)
                if self._waiting is None:
                    self._waiting = threading.Condition(self._mutex)
        return self._waiting

    def _changed(self, event: Event | None) -> None:
        # (called with the lock held) nobody waits for a non-terminal event unless events() does
        if self._waiting is not None and (event is None or event.terminal or self._followers):
            self._waiting.notify_all()

    def result(self, timeout: float | None = None) -> Any:
        """The call's result; raises its typed error, CallCancelled, or CallTimeout."""
        if self.refused is None:
            self._wait(timeout)
        return run_steps(self._outcome(self.gateway.conn))

    def _wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        check = 0.0
        unreachable: Exception | None = None
        while not self.settled():
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            with self._cv:
                if not self.settled():
                    self._cv.wait(wait)
            if self.settled():
                return
            # Pub/sub is fire-and-forget: now and then read the durable history directly.
            if time.monotonic() >= check:
                check = time.monotonic() + 1.0
                try:
                    self.sync(LIVE_GRACE)  # (a later events() lists what the live feed still had)
                    unreachable = None
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    # A broker restart: the call goes on (its worker keeps it) and so does the wait.
                    unreachable = e
                if self.settled():
                    return
            if deadline is not None and time.monotonic() >= deadline:
                if unreachable is not None:
                    raise BrokerUnavailable(
                        f"no result for call {self.call_id} ({self.name}) within {timeout:g}s: the broker "
                        f"did not answer ({unreachable})",
                        call_id=self.call_id,
                    )
                raise CallTimeout(f"no result for call {self.call_id} ({self.name}) within {timeout:g}s", call_id=self.call_id)

    def sync(self, live_grace: float = 0.0) -> None:
        """Fetch any events we have not seen from the call's durable history. ``live_grace``: when it holds
        only the call's kept end past unseen events, first give the event thread that long to deliver them
        (published before the end, they may be unread in our subscription still)."""
        seen = self.last_seq
        history = ev_mod.history(self.gateway.conn, self.call_id, seen + 1)
        if live_grace > 0 and self.own and ev_mod.ends_past_a_gap(history, seen):
            deadline = time.monotonic() + live_grace
            with self._cv:
                self._followers += 1  # (so the event thread wakes us for every event, not just the end)
                try:
                    while not self.done() and (left := deadline - time.monotonic()) > 0:
                        self._cv.wait(left)
                finally:
                    self._followers -= 1
        for event in history:
            self.feed(event)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Every event of the call in order (those already seen first), until the terminal one."""
        if not self.own:  # what it saw already, then the rest (an ended call's history is its end alone)
            with self._cv:
                seen = list(self._events)
            yield from seen
            if not (seen and seen[-1].terminal):
                after = seen[-1].seq if seen else 0
                yield from ev_mod.follow(self.gateway.conn, self.call_id, timeout=timeout, after=after)
            return
        i = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while (event := self._next(i, deadline)) is not None:
            i += 1
            yield event
            if event.terminal:
                return

    def _next(self, i: int, deadline: float | None) -> Event | None:
        """Event number ``i``, waiting for it; None when refused or out of time."""
        while True:
            with self._cv:
                if i < len(self._events):
                    return self._events[i]
                if self.refused is not None or self.abandoned is not None:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._followers += 1
                try:
                    woken = self._cv.wait(1.0 if left is None else min(left, 1.0))
                finally:
                    self._followers -= 1
                if woken:
                    continue
            # Quiet for a second: read the durable history in case pub/sub dropped one (a broker restart:
            # keep following until the deadline).
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                self.sync(LIVE_GRACE)

    def cancel(self) -> bool:
        """Ask for the call to stop: at once while it waits, through its worker while it runs."""
        return self.gateway.cancel(self.call_id)


class Batch(Handles[CallHandle]):
    """A batch's ``CallHandle``s (``Gateway.map`` / ``submit_many``)."""


def cancel_unended(handles: Iterable[CallHandle]) -> int:
    """Cancel those of ``handles`` whose calls have not ended (a command's Ctrl-C: the calls it waits on
    stop too); how many were. A broker failing meanwhile spoils only that one: the rest are still tried."""
    cancelled = 0
    for handle in handles:
        with contextlib.suppress(HermesError, redis.RedisError):
            cancelled += bool(not handle.done() and handle.cancel())
    return cancelled


@contextlib.contextmanager
def interrupt_after() -> Iterator[None]:
    """Hold a Ctrl-C that comes inside the block until it ends (a call being submitted then has its
    handle, so the command can cancel it); KeyboardInterrupt is raised then. In the main thread only, and
    not where Ctrl-C is ignored (``nohup``, a background job of a script)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    caught: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    except BaseException:
        signal.signal(signal.SIGINT, old)
        if caught:  # (the block failed too: the Ctrl-C still ends the command)
            raise KeyboardInterrupt from None
        raise
    signal.signal(signal.SIGINT, old)
    if caught:
        raise KeyboardInterrupt
