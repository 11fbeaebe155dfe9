"""Python tools the MCP-over-HTTP tests point specs at (run by real workers)."""

from __future__ import annotations

import time
from typing import Any


def steps(n: int, ctx: Any) -> dict[str, int]:
    """Report ``n`` progress messages, a little apart, then return."""
    for i in range(1, n + 1):
        ctx.progress(f"step {i} of {n}")
        time.sleep(0.05)
    return {"steps": n}


def chatty(n: int, ctx: Any) -> dict[str, int]:
    """Report ``n`` progress messages at once (a streamed reply's many events), then return."""
    for i in range(n):
        ctx.progress(f"chunk {i}")
    return {"chunks": n}
