"""Callables the python-executor tests point specs at."""

from __future__ import annotations

import asyncio
import datetime

from broker.errors import InvalidArgs


def add(a: int, b: int = 1) -> int:
    return a + b


def with_progress(n: int, ctx) -> dict:
    ctx.progress(f"counting to {n}")
    return {"n": n, "call_id": ctx.call_id}


def explode(message: str) -> None:
    raise ValueError(message)


def typed_failure() -> None:
    raise InvalidArgs("bad city", violations=["$.city: unknown"])


def not_serialisable() -> object:
    return {"when": datetime.datetime(2024, 1, 1)}


async def aadd(a: int, b: int) -> dict:
    await asyncio.sleep(0)
    return {"sum": a + b, "pair": (a, b)}


async def aslow(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "finished"


def non_finite() -> dict[str, float]:
    """Numbers JSON has no text for (the HTTP API sends them as null)."""
    return {"nan": float("nan"), "inf": float("inf"), "ok": 1.5}


def tagged(name: str, **extra: object) -> dict:
    """A required parameter and ``**kwargs``: any further name is taken."""
    return {"name": name, **extra}


def positional_only(a: int, /) -> int:
    return a


def exits(code: int) -> None:
    """What argparse's error does on an argument it refuses (and any ``sys.exit`` in a tool)."""
    raise SystemExit(code)


def interrupted() -> None:
    raise KeyboardInterrupt("tool code raised it")


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str exploded")


def unprintable() -> None:
    raise _Unprintable()


def holds_itself() -> list:
    out: list = []
    out.append(out)
    return out
