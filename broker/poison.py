"""Poison records: a call record a worker cannot read (in a batch of claims, reaps or due retries) is
settled alone, never blocking the others: ``failed`` with ``bad_payload`` when its record names a channel
to tell its caller on, else dropped (off the leases and its slot) with an error in the log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from . import keys
from .codec import text
from .errors import DecodeError
from .otel import new_span_id
from .states import TERMINAL, State

if TYPE_CHECKING:
    from .calls import Calls

log = structlog.get_logger("hermes.poison")


def row_problem(values: dict[str, Any]) -> str:
    """What makes a row unreadable, for the error: the fields that did not convert, as they were."""
    return ", ".join(f"{k}={text(v)!r}"[:200] for k, v in values.items())


def settle(calls: Calls, raw_id: Any, reason: str) -> str:
    """Fail (or drop) the call of one unreadable row; returns "failed", "dropped" or "gone". Never raises
    for a broker error: the batch it came from goes on (a call left leased is the reaper's again)."""
    try:
        call_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
    except UnicodeDecodeError:
        calls.conn.zrem(keys.leases(keys.tag_in(raw_id.decode(errors="replace"))), raw_id)
        log.error("unreadable call record dropped: its id is not text", call_id=repr(raw_id)[:200], reason=reason)
        return "dropped"
    try:
        return _settle(calls, call_id, reason)
    except Exception as e:  # noqa: BLE001 - one bad record must not take the batch down with it
        log.error("could not settle an unreadable call record", call_id=call_id, reason=reason, error=str(e))
        return "gone"


def _settle(calls: Calls, call_id: str, reason: str) -> str:
    conn = calls.conn
    raw = conn.hmget(
        keys.job(call_id), keys.F_STATE, keys.F_CHANNEL, keys.F_CKEY, keys.F_TRACE, keys.F_KIND, keys.F_TOOL, "origin",
        keys.F_SESSION,
    )
    state, chan, ckey, trace, kind, tool, origin, session = (text(v) for v in raw)
    tag = keys.tag(origin) if origin else keys.tag_in(call_id)  # (its queue's keys)
    if not state or state in TERMINAL:
        conn.zrem(keys.leases(tag), call_id)
        return "gone"
    message = f"call record {call_id} cannot be read ({reason}); the call is failed, not run"
    error = DecodeError(message, call_id=call_id).to_wire()
    if chan:
        from .calls import CallInfo  # (calls imports this module)

        info = CallInfo(call_id, trace, new_span_id(), kind or "tool", tool, session or None, chan, ckey, origin)
        reply = calls.transition(info, State.FAILED, attempt=1, fence=False, detail={"error": error})
        if int(reply[0]) > 0:
            log.error("unreadable call record failed", call_id=call_id, reason=reason)
            return "failed"
    pipe = conn.pipeline(transaction=False)
    pipe.zrem(keys.leases(tag), call_id)
    if ckey:
        pipe.zrem(keys.slots(tag, ckey), call_id)
    pipe.execute()
    log.error("unreadable call record dropped: nothing to tell its caller on", call_id=call_id, reason=reason)
    return "dropped"
