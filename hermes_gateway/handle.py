"""CallHandle: the caller's view of one submitted call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import redis

from broker import events as ev_mod
from broker import keys
from broker.codec import pack, text
from broker.errors import BrokerUnavailable, CallCancelled, CallTimeout, HermesError, error_from_wire
from broker.events import Event
from broker.states import TERMINAL, State

if TYPE_CHECKING:
    from hermes_gateway.client import Gateway

_MISSING = object()


class CallHandle:
    """A submitted call: wait for its result, follow its events, or cancel it."""

    def __init__(self, gateway: Gateway, call_id: str, name: str, kind: str = "tool", *, own: bool = True) -> None:
        self.gateway = gateway
        self.call_id = call_id
        self.name = name
        self.kind = kind
        self.own = own  # events arrive on our channel (False: someone else's call, followed from Redis)
        self.refused: HermesError | None = None
        self._events: list[Event] = []
        # One condition for new events and for the end (a plain lock: never re-entered, and cheaper);
        # a handle per call is made by every submission, so it carries no second Event of its own.
        self._cv = threading.Condition(threading.Lock())
        self._over = False  # a terminal event arrived, or the call was refused
        self._followers = 0  # threads waiting in events() for the next event (result() waits for the end)
        self._result: Any = _MISSING
        self._final: Event | None = None

    def __repr__(self) -> str:
        return f"<CallHandle {self.name} {self.call_id} {self.state}>"

    # -- fed by the gateway's dispatcher ---------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self._events[-1].seq if self._events else 0

    def _feed(self, event: Event) -> None:
        with self._cv:
            if event.seq <= self.last_seq:
                return
            self._events.append(event)
            if event.terminal:
                self._final = event
                self._over = True
                self._cv.notify_all()
            elif self._followers:  # nobody waits for a non-terminal event unless events() does
                self._cv.notify_all()
        if event.terminal and self.own:  # however the end was seen (pub/sub or a history read)
            self.gateway._untrack(self.call_id, self)

    def _refuse(self, error: HermesError) -> None:
        with self._cv:
            self.refused = error
            self._over = True
            self._cv.notify_all()

    # -- public ----------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        if self.refused is not None:
            return "refused"
        for event in reversed(self._events):
            if event.type == ev_mod.TRANSITION:
                return event.state
        return str(State.PENDING)

    @property
    def trace_id(self) -> str:
        return self._events[0].trace_id if self._events else ""

    def done(self) -> bool:
        return self._over

    def result(self, timeout: float | None = None) -> Any:
        """The call's result; raises its typed error, CallCancelled, or CallTimeout."""
        if self.refused is not None:
            raise self.refused
        self._wait(timeout)
        if self.refused is not None:
            raise self.refused
        final = self._final
        assert final is not None
        if final.state == State.DONE:
            if self._result is _MISSING:
                if "result" in final.detail:
                    self._result = final.detail["result"]
                else:
                    rec = self.gateway.calls.record(self.call_id) or {}
                    self._result = rec.get("result")
            return self._result
        error = final.detail.get("error") or {}
        if final.state == State.CANCELLED:
            raise CallCancelled(error.get("message") or f"call {self.call_id} was cancelled")
        raise error_from_wire(error)

    def _wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        check = 0.0
        unreachable: Exception | None = None
        while not self._over:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            with self._cv:
                if not self._over:
                    self._cv.wait(wait)
            if self._over:
                return
            # Pub/sub is fire-and-forget: now and then read the durable history directly.
            if time.monotonic() >= check:
                check = time.monotonic() + 1.0
                try:
                    self.sync()
                    unreachable = None
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    # A broker restart: the call goes on (its worker keeps it) and so does the wait.
                    unreachable = e
                if self._over:
                    return
            if deadline is not None and time.monotonic() >= deadline:
                if unreachable is not None:
                    raise BrokerUnavailable(
                        f"no result for call {self.call_id} ({self.name}) within {timeout:g}s: the broker "
                        f"did not answer ({unreachable})",
                        call_id=self.call_id,
                    )
                raise CallTimeout(f"no result for call {self.call_id} ({self.name}) within {timeout:g}s", call_id=self.call_id)

    def sync(self) -> None:
        """Fetch any events we have not seen from the call's durable history."""
        for event in ev_mod.history(self.gateway.conn, self.call_id, self.last_seq + 1):
            self._feed(event)

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
        while True:
            event = self._next(i, deadline)
            if event is None:
                return
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
                if self.refused is not None:
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
            try:
                self.sync()  # quiet for a second: read the durable history in case pub/sub dropped one
            except (redis.ConnectionError, redis.TimeoutError):
                pass  # a broker restart: keep following until the deadline

    def cancel(self) -> bool:
        """Ask for the call to stop: at once while it waits, through its worker while it runs."""
        return self.gateway.cancel(self.call_id)

    @property
    def final_state(self) -> str | None:
        return self._final.state if self._final else None


CANCEL_FIELDS = (keys.F_STATE, keys.F_ATTEMPT, keys.F_TRACE, keys.F_KIND, keys.F_TOOL, keys.F_CHANNEL, keys.F_CKEY, "origin", "data")
PENDING_CANCEL = {"type": "cancelled", "message": "cancelled by the caller before it started"}


def cancelled_record(call_id: str, kind: str, tool: str, trace: str, attempt: int, data: Any, sensitive: Any) -> Any:
    """The audit record of a call cancelled while pending (no worker ran it, so the caller writes it)."""
    from broker.audit import AuditRecord, context_fields
    from broker.records import envelope_of

    try:
        env = envelope_of(data) if data else None
    except HermesError:
        env = None
    context = env.context if env is not None else {}
    return AuditRecord.of(
        call_id=call_id,
        kind=kind,
        state=str(State.CANCELLED),
        args=env.args if env is not None else None,
        sensitive=tuple(sensitive or ()),
        request=env.request if env is not None and kind == "llm" else None,
        error=PENDING_CANCEL,
        tool_name=tool if kind == "tool" else None,
        model=tool if kind == "llm" else None,
        **context_fields(context),
        trace_id=trace,
        attempts=attempt,
    )


def cancel_call(gateway: Gateway, call_id: str) -> bool:
    """Cancel by id; True when the request was recorded (the call was not already finished)."""
    from broker.audit_store import AuditLog
    from broker.records import CallInfo

    conn = gateway.conn
    raw = conn.hmget(keys.job(call_id), *CANCEL_FIELDS)
    if raw[0] is None:
        return False
    data = raw[-1]
    state, attempt, trace, kind, tool, chan, ckey, origin = (text(v) for v in raw[:-1])
    if state in TERMINAL:
        return False
    leased = conn.zscore(keys.leases(keys.tag(origin)), call_id)
    info = CallInfo(call_id, trace, "", kind, tool, None, chan, ckey, origin)
    # Still pending and not taken by a worker: it ends here and now. A worker that has taken it (it is
    # leased) is told instead, so its slot is given back only when it has really stopped.
    if state == State.PENDING and leased is None:
        err = PENDING_CANCEL
        reply = gateway.calls.cancel_unleased(info, attempt=int(attempt or 1), error=err)
        if int(reply[0]) > 0:
            # No worker ran it, so none writes its audit record: the README promises one per call.
            sensitive: tuple[str, ...] = ()
            if kind == "tool":
                try:
                    sensitive = gateway.directory.get(tool).spec.sensitive
                except HermesError:
                    pass  # removed meanwhile: its arguments are still redacted by name
            record = cancelled_record(call_id, kind, tool, trace, int(attempt or 1), data, sensitive)
            AuditLog.from_settings(conn, gateway.settings.audit).append(record)
            return True
    conn.hset(keys.job(call_id), keys.F_CANCEL, "1")
    conn.publish(keys.channel(conn, keys.CONTROL_CHANNEL), pack({"op": "cancel", "call_id": call_id}))
    return True


class _Settled(Protocol):
    refused: HermesError | None


H = TypeVar("H", bound=_Settled)


class Handles(list[H]):
    """The handles of a batch, in submission order; ``accepted`` and ``refused`` split them."""

    @property
    def accepted(self) -> list[H]:
        return [h for h in self if h.refused is None]

    @property
    def refused(self) -> list[tuple[int, H]]:
        """(index in the batch, handle) of each refused item; ``handle.refused`` is its error."""
        return [(i, h) for i, h in enumerate(self) if h.refused is not None]


class Batch(Handles[CallHandle]):
    """A batch's ``CallHandle``s (``Gateway.map`` / ``submit_many``)."""
