"""Built-in python-executor callables for tests, benchmarks and smoke checks."""

from __future__ import annotations

import time
from typing import Any

from broker.errors import CallCancelled, ToolTimeout

from . import ExecContext


def noop(ctx: ExecContext | None = None, **kwargs: Any) -> None:
    """Do nothing: the cheapest tool, for measuring the gateway; it takes ``ctx``, so it runs inline."""
    return None


def echo(ctx: ExecContext | None = None, **kwargs: Any) -> dict[str, Any]:
    """Return the arguments unchanged (on the call's thread, like ``noop``)."""
    return kwargs


def sleep(seconds: float, ctx: ExecContext) -> dict[str, float]:
    """Wait ``seconds``; a cancelled call stops at once."""
    left = ctx.deadline - time.monotonic()
    if ctx.cancelled.wait(max(0.0, min(float(seconds), left))):
        raise CallCancelled(f"call {ctx.call_id} was cancelled")
    if float(seconds) > left:
        raise ToolTimeout(f"tool {ctx.tool_name!r} timed out after {ctx.timeout:g}s", timeout=ctx.timeout)
    return {"slept": float(seconds)}
