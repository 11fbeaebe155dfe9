"""Helpers for the end-to-end tests: read calls back from Redis, start and reach servers."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import Any

import httpx
import redis

from broker import events, keys
from broker.states import TERMINAL

TRANSITION = events.TRANSITION


def histories(conn: redis.Redis, call_ids: list[str]) -> dict[str, list[events.Event]]:
    """Every call's stored events, read in one pipeline (an ended call's are all there only with the
    ``keep_history`` fixture: else its terminal event alone)."""
    pipe = conn.pipeline(transaction=False)
    for cid in call_ids:
        pipe.lrange(keys.history(cid), 0, -1)
        pipe.get(keys.ended(cid))
    got = pipe.execute()
    return {cid: events.unseen(got[2 * i], got[2 * i + 1], 0, cid) for i, cid in enumerate(call_ids)}


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[Any] | None = None, timeout: float = 30.0) -> httpx.Response:
    """GET ``url`` until something answers (``proc``, when given, must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url, timeout=2)
        except httpx.TransportError:
            if proc is not None and proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr else ""
                raise AssertionError(f"the server exited with {proc.returncode} before answering: {err}") from None
            assert time.monotonic() < deadline, f"nothing answered at {url} within {timeout:g}s"
            time.sleep(0.1)
