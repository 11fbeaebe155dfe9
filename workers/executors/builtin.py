"""Built-in python-executor callables for tests, benchmarks and smoke checks."""

from __future__ import annotations

import time
from typing import Any

from broker.errors import CallCancelled, ToolTimeout

from . import ExecContext


def noop(ctx: ExecContext | None = None, **kwargs: Any) -> None:
    """Do nothing: the cheapest possible tool, for measuring the gateway itself. It takes ``ctx``, so it
    runs on the call's thread (it cannot overrun a deadline: it returns at once)."""
    return None


def echo(ctx: ExecContext | None = None, **kwargs: Any) -> dict[str, Any]:
    """Return the arguments unchanged (on the call's thread, like ``noop``)."""
    return kwargs


def sleep(seconds: float, ctx: ExecContext | None = None) -> dict[str, float]:
    """Wait ``seconds``; a cancelled call stops at once."""
    if ctx is None:
        time.sleep(float(seconds))
        return {"slept": float(seconds)}
    left = ctx.deadline - time.monotonic()
    if ctx.cancelled.wait(max(0.0, min(float(seconds), left))):
        raise CallCancelled(f"call {ctx.call_id} was cancelled")
    if float(seconds) > left:
        raise ToolTimeout(f"tool {ctx.tool_name!r} timed out after {ctx.timeout:g}s", timeout=ctx.timeout)
    return {"slept": float(seconds)}
