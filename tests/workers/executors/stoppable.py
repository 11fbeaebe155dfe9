"""Callables for the python-executor timeout tests: they ignore ``ctx`` (none takes it) and record
what happened to them in module state, so a test can see whether they were stopped."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

events: dict[str, list[str]] = {}  # tag -> what the function got to
counters: dict[str, int] = {}
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def _note(tag: str, what: str) -> None:
    events.setdefault(tag, []).append(what)


def sleeper(seconds: float, tag: str = "") -> dict:
    """Blocked in C (time.sleep): it can only be stopped once the sleep returns."""
    _note(tag, "start")
    try:
        time.sleep(seconds)
        _note(tag, "after-sleep")  # not reached when abandoned: ToolStopped fires as sleep returns
    except BaseException as e:
        _note(tag, type(e).__name__)
        raise
    return {"slept": seconds, "tag": tag}


def spinner(tag: str, limit: float = 20.0) -> int:
    """A pure-Python busy loop that swallows ordinary exceptions; bounded by ``limit`` seconds."""
    _note(tag, "start")
    end = time.monotonic() + limit
    try:
        while time.monotonic() < end:
            try:
                counters[tag] = counters.get(tag, 0) + 1
            except Exception:  # noqa: BLE001 - a careless tool: this must not catch ToolStopped
                pass
    except BaseException as e:
        _note(tag, type(e).__name__)
        raise
    _note(tag, "ran-out")
    return counters[tag]


async def asleeper(seconds: float, tag: str = "") -> str:
    _note(tag, "start")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _note(tag, "CancelledError")
        raise
    _note(tag, "finished")
    return "finished"


async def aspinner(tag: str, limit: float = 20.0) -> int:
    """An async function that never awaits: its loop cannot cancel it (only a ToolStopped stops it)."""
    return spinner(tag, limit)


async def atidy(seconds: float, tag: str = "", tidy: float = 0.3) -> str:
    """Sleeps; when cancelled, tidies up for ``tidy`` seconds (blocking, as cleanup code may) before it notes it."""
    _note(tag, "start")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        time.sleep(tidy)
        _note(tag, "tidied")
        raise
    return "finished"


def whoami() -> dict:
    return {"thread": threading.get_ident(), "request_id": request_id.get()}


def whoami_ctx(ctx) -> dict:
    return {"thread": threading.get_ident(), "call_id": ctx.call_id}


def nothing() -> None:
    return None


def boom() -> None:
    raise KeyError("nope")
