"""Python tools for the python-executor timeout tests (only ``stubborn`` takes ``ctx``); each records in files
(``<path>.log`` lines, ``<path>.count``) what happened to it inside the worker process."""

from __future__ import annotations

import asyncio
import os
import time


def _note(path: str, what: str) -> None:
    with open(f"{path}.log", "a", encoding="utf-8") as f:
        f.write(what + "\n")


def nap(seconds: float, path: str) -> dict:
    """Blocked in C for ``seconds``; ignores cancellation."""
    _note(path, "start")
    try:
        time.sleep(seconds)
    except BaseException as e:
        _note(path, type(e).__name__)
        raise
    _note(path, "after-sleep")
    return {"slept": seconds}


def spin(path: str, limit: float = 20.0) -> int:
    """A pure-Python busy loop (bounded by ``limit`` s) writing its counter every 20,000 rounds."""
    _note(path, "start")
    n = 0
    end = time.monotonic() + limit
    try:
        while time.monotonic() < end:
            n += 1
            if n % 20_000 == 0:
                with open(f"{path}.tmp", "w", encoding="utf-8") as f:
                    f.write(str(n))
                os.replace(f"{path}.tmp", f"{path}.count")  # whole numbers only, even if stopped mid-write
    except BaseException as e:
        _note(path, type(e).__name__)
        raise
    _note(path, "ran-out")
    return n


async def anap(seconds: float, path: str) -> str:
    _note(path, "start")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _note(path, "CancelledError")
        raise
    _note(path, "finished")
    return "finished"


def stubborn(seconds: float, path: str, ctx: object) -> dict:
    """Takes ``ctx`` (so it runs on the call's own thread) and never looks at its cancel."""
    return nap(seconds, path)
