"""Events: one per state transition (and per progress message or stream delta), a msgpack map.

``seq`` is added by the script that appends the event to the call's history and publishes it, so it rises
by exactly one per call and a subscriber can see a gap. Late subscribers read the history, then the live
tail (``follow``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import structlog

from . import keys
from .codec import pack, raw, unpack
from .connection import is_cluster, subscriber
from .errors import DecodeError
from .states import STEP_STATES, TERMINAL

log = structlog.get_logger("hermes.events")

SUBSCRIBE_WAIT = 5.0  # seconds a late follower on a cluster waits for its subscription to be confirmed
TRANSITION = "transition"
PROGRESS = "progress"
DELTA = "delta"


@dataclass(frozen=True)
class Event:
    """One event of one call."""

    call_id: str
    seq: int
    state: str
    ts: float
    trace_id: str
    span_id: str
    attempt: int
    kind: str
    tool_name: str | None = None
    model: str | None = None
    session_id: str | None = None
    type: str = TRANSITION
    detail: dict[str, Any] = field(default_factory=dict)
    # On the terminal event an ended call keeps in place of its history: its earlier transitions,
    # ``[state, attempt, microseconds before this event]`` each, in order.
    steps: list[list[Any]] | None = None

    @property
    def terminal(self) -> bool:
        return self.type == TRANSITION and self.state in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        out = self.__dict__.copy()  # (its fields, in order: no slots, no cached extras)
        if not out["steps"]:
            del out["steps"]
        return out


def payload(
    *, call_id: str, state: str, trace_id: str, span_id: str, attempt: int, kind: str, name: str,
    session_id: str | None, type: str = TRANSITION, detail: dict[str, Any] | None = None,
    ts: float | None = None,
) -> bytes:
    """Encode an event without ``seq`` (the script adds it): ``tool_name`` or ``model``, whichever the kind
    has, and ``type`` only when it is not a transition (an ended call keeps this event: each byte counts).
    ``decode`` fills the absent ones in."""
    out: dict[str, Any] = {
        "call_id": call_id,
        "state": state,
        "ts": time.time() if ts is None else ts,
        "trace_id": trace_id,
        "span_id": span_id,
        "attempt": attempt,
        "kind": kind,
    }
    if kind == "tool":
        out["tool_name"] = name
    elif kind == "llm":
        out["model"] = name
    out["session_id"] = session_id
    if type != TRANSITION:
        out["type"] = type
    out["detail"] = detail or {}
    return pack(out)


def decode(data: bytes, call_id: str | None = None) -> Event:
    """Decode one published or stored event. ``call_id``: the call whose history it was read from (an
    ended call's kept terminal event leaves its id out: broker/lua/transition.lua)."""
    raw = unpack(data)
    if isinstance(raw, dict) and call_id is not None:
        raw.setdefault("call_id", call_id)
    if not isinstance(raw, dict) or not isinstance(raw.get("call_id"), str) or "seq" not in raw:
        raise DecodeError("not an event")
    detail = raw.get("detail") or {}
    if not isinstance(detail, dict):
        raise DecodeError("not an event: its detail is not a mapping")
    # Filled in directly, not through the frozen dataclass's __init__: a caller decodes every event.
    event = object.__new__(Event)
    try:  # a malformed message (a seq that is no number, say) is a DecodeError, never a crash of the reader
        ts = float(raw.get("ts") or 0.0)
        event.__dict__.update(
            call_id=raw["call_id"],
            seq=int(raw["seq"]),
            state=str(raw.get("state") or ""),
            ts=ts,
            trace_id=raw.get("trace_id") or "",
            span_id=raw.get("span_id") or "",
            attempt=int(raw.get("attempt") or 0),
            kind=raw.get("kind") or "",
            tool_name=raw.get("tool_name"),
            model=raw.get("model"),
            session_id=raw.get("session_id"),
            type=raw.get("type") or TRANSITION,
            detail=detail,
            steps=_steps(raw.get("steps"), ts),
        )
    except (TypeError, ValueError, OverflowError) as e:
        raise DecodeError(f"not an event: {e}") from e
    return event


def _steps(raw: Any, ts: float) -> list[list[Any]] | None:
    """An ended call's ``steps`` (``[state, attempt, µs before ts, seq]`` each) from the record's
    ``h_steps`` text (``broker.calls.step_text``: ``#<seq>`` opens a write, each step names its event's
    place in it; a time of 16 digits is decimal; seq None in a text written before steps had places), or
    None when absent or unreadable."""
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    if not isinstance(raw, str):
        return None
    end = round(ts * 1e6)
    out: list[list[Any]] = []
    base = None
    try:
        for part in raw.split(";"):
            if part.startswith("#"):  # a write's first seq, then its first step
                rest = part[1:].lstrip("0123456789")
                base, part = int(part[1 : len(part) - len(rest)]), rest
            if not part:
                continue
            head, at, *place = part.split(" ")
            seq = base + int(place[0]) if place and base is not None else None
            out.append([STEP_STATES[head[0]], int(head[1:]), end - (int(at) if len(at) >= 16 else int(at, 16)), seq])
    except (KeyError, IndexError, ValueError):
        return None
    return out


def missed_moves(end: Event, last: int, moved: int) -> list[Event]:
    """The transitions before ``end`` (an ended call's kept terminal event) that a follower which saw up
    to seq ``last``, ``moved`` transitions of them, never got, rebuilt from its steps (no span id, no
    detail) with their own seqs (those after ``last``). Steps written before they carried seqs: the ones
    past the first ``moved``, numbered into the gap before the end (empty when they would not fit)."""
    if not end.steps:
        return []
    if all(step[3] is not None for step in end.steps):
        missed = [(step, step[3]) for step in end.steps if last < step[3] < end.seq]
    else:
        rest = end.steps[moved:]
        if len(rest) > end.seq - last - 1:
            return []
        missed = [(step, last + 1 + i) for i, step in enumerate(rest)]
    return [
        dataclasses.replace(end, seq=seq, state=str(step[0]), attempt=int(step[1]),
                            ts=end.ts - step[2] / 1e6, span_id="", detail={}, steps=None)
        for step, seq in missed
    ]


def filled(evs: Sequence[Event], last: int = 0, moved: int = 0) -> list[Event]:
    """``evs`` (read after seq ``last``, ``moved`` transitions seen before) with the moves an ended call's
    kept end carries as steps rebuilt before it (``missed_moves``): what a reader of a trimmed history is
    shown."""
    out: list[Event] = []
    for ev in evs:
        if ev.terminal and ev.seq > last + 1:
            out += missed_moves(ev, last, moved)
        out.append(ev)
        last, moved = ev.seq, moved + (ev.type == TRANSITION)
    return out


def for_handle(handles: Mapping[str, Any], data: bytes) -> tuple[Event, Any, bool] | None:
    """A caller's channel message as ``(event, the handle it is for, True when seq skipped some)``; None
    when it is not an event (logged) or no handle of ``handles`` (by call id) waits for it."""
    if not data:  # a wake-up (a client closing publishes one to its channel), not an event
        return None
    try:
        event = decode(data)
    except DecodeError:
        log.warning("undecodable event on the caller channel")
        return None
    handle = handles.get(event.call_id)
    if handle is None:
        return None
    return event, handle, event.seq > handle.last_seq + 1


def history(conn: redis.Redis, call_id: str, start_seq: int = 1) -> list[Event]:
    """Stored events of a call from ``start_seq`` on: its history list (index = seq - 1) while it runs,
    its terminal event alone (``keys.ended``) once it has ended, read together (``unseen``)."""
    pipe = conn.pipeline(transaction=False)
    pipe.lrange(keys.history(call_id), max(start_seq - 1, 0), -1)
    pipe.get(keys.ended(call_id))
    stored, end = pipe.execute()
    return unseen(stored, end, start_seq - 1, call_id)


def unseen(stored: list[Any], end: Any, seen: int, call_id: str) -> list[Event]:
    """The events after seq ``seen``, from ``LRANGE history seen -1`` (``stored``) and ``GET ended``
    (``end``) read together: the range, then the kept end when it is newer than all of them."""
    out = [decode(raw(b), call_id) for b in stored]
    if end is not None:
        ev = decode(raw(end), call_id)
        if ev.seq > (out[-1].seq if out else seen):
            out.append(ev)
    return out


def ends_past_a_gap(events: Sequence[Event], seen: int) -> bool:
    """Whether ``events`` (read after seq ``seen``) end with a terminal event past a gap of missing ones."""
    prev = seen
    for e in events:
        if e.terminal and e.seq > prev + 1:
            return True
        prev = e.seq
    return False


def follow(
    conn: redis.Redis, call_id: str, *, timeout: float | None = None, poll: float = 1.0, after: int = 0
) -> Iterator[Event]:
    """History then live tail of one call, each event once, in seq order, until a terminal event (subscribed
    before the history is read; a gap in the tail is filled from the history). ``after``: the seq seen."""
    last, moved = after, 0  # (transitions seen: for an end past a gap written before steps had seqs)
    channel = conn.hget(keys.job(call_id), keys.F_CHANNEL)
    if channel is None:  # (an ended call's record names no channel: its history has the end)
        yield from filled(history(conn, call_id, after + 1), after)
        return
    pubsub = subscriber(conn)
    get = _subscribe(conn, pubsub, channel)
    try:
        quiet, deadline = False, None
        fresh = history(conn, call_id, after + 1)
        while True:
            for ev in filled(fresh, last, moved):
                last, moved = ev.seq, moved + (ev.type == TRANSITION)
                yield ev
                if ev.terminal:
                    return
            if deadline is None and timeout is not None:  # (counted once the first history is out)
                deadline = time.monotonic() + timeout
            elif quiet and deadline is not None and time.monotonic() >= deadline:
                return
            wait = poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic()))
            msg = get(wait)
            quiet = msg is None  # then the history again, in case a message was lost on the way
            fresh = history(conn, call_id, last + 1) if quiet else _live(conn, call_id, msg["data"], last)
    finally:
        pubsub.close()


def _live(conn: Any, call_id: str, data: Any, last: int) -> list[Event]:
    """A live message's event if it is this call's next after seq ``last``, behind those of the history it
    skipped; none when it is not."""
    try:
        ev = decode(data)
    except DecodeError:
        return []
    if ev.call_id != call_id or ev.seq <= last:
        return []
    skipped = history(conn, call_id, last + 1) if ev.seq > last + 1 else []
    return [*itertools.takewhile(lambda missing: missing.seq < ev.seq, skipped), ev]


def _subscribe(conn: Any, pubsub: Any, channel: Any) -> Callable[[float], Any]:
    """Subscribe to a call's channel, confirmed; returns the function reading its next message (None when
    quiet). On a cluster the channel is sharded (SSUBSCRIBE, in the call's slot)."""
    if not is_cluster(conn):
        pubsub.subscribe(channel)
        return lambda wait: pubsub.get_message(timeout=wait)
    pubsub.ssubscribe(channel)
    deadline = time.monotonic() + SUBSCRIBE_WAIT
    while time.monotonic() < deadline:  # confirmed before the history is read: nothing falls in between
        msg = pubsub.get_sharded_message(timeout=0.1)
        if msg is not None and msg["type"] == "ssubscribe":
            break

    def get(wait: float) -> Any:
        msg = pubsub.get_sharded_message(timeout=wait)
        return msg if msg is not None and msg["type"] == "smessage" else None

    return get

