"""Helpers for the end-to-end tests: read calls back from Redis."""

from __future__ import annotations

from typing import Any

import redis

from broker import events, keys
from broker.states import TERMINAL

TRANSITION = events.TRANSITION


def histories(conn: redis.Redis, call_ids: list[str]) -> dict[str, list[events.Event]]:
    """Every call's stored events, read in one pipeline."""
    pipe = conn.pipeline(transaction=False)
    for cid in call_ids:
        pipe.lrange(keys.history(cid), 0, -1)
    return {cid: [events.decode(b) for b in raw] for cid, raw in zip(call_ids, pipe.execute(), strict=True)}


def states(conn: redis.Redis, call_id: str) -> list[str]:
    """The call's transitions so far (progress events left out)."""
    return [e.state for e in events.history(conn, call_id) if e.type == TRANSITION]


def field(conn: redis.Redis, call_id: str, name: str) -> str:
    raw = conn.hget(keys.job(call_id), name)
    return raw.decode() if raw is not None else ""


def current(conn: redis.Redis, call_ids: list[str]) -> dict[str, str]:
    """Each call's state right now."""
    pipe = conn.pipeline(transaction=False)
    for cid in call_ids:
        pipe.hget(keys.job(cid), keys.F_STATE)
    return {cid: (v or b"").decode() for cid, v in zip(call_ids, pipe.execute(), strict=True)}


def all_terminal(conn: redis.Redis, call_ids: list[str]) -> bool:
    return all(s in TERMINAL for s in current(conn, call_ids).values())


def error_type(conn: redis.Redis, call_id: str) -> Any:
    from broker.calls import Calls

    rec = Calls(conn).record(call_id) or {}
    return (rec.get("error") or {}).get("type")
