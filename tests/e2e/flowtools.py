"""Python-executor tools for the flow-control tests: a back end whose health a file decides.

Every call that reaches the back end appends a line to ``log``, so a test can count exactly which calls
touched it (a breaker must keep the others away).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def backend(mode_file: str, log: str, tag: str = "", hold: float = 0.0) -> dict[str, Any]:
    """Fail (RuntimeError -> executor_error) while ``mode_file`` says ``fail``; else answer after ``hold`` s."""
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()} {tag}\n")
    if hold:
        time.sleep(hold)
    if Path(mode_file).read_text(encoding="utf-8").strip() == "fail":
        raise RuntimeError("back end is down")
    return {"ok": True, "tag": tag}


def fail_times(counter: str, times: int) -> dict[str, Any]:
    """Fail the first ``times`` calls (counted in the ``counter`` file), then succeed."""
    path = Path(counter)
    n = int(path.read_text(encoding="utf-8") or 0) + 1 if path.exists() else 1
    path.write_text(str(n), encoding="utf-8")
    if n <= times:
        raise RuntimeError(f"failure {n} of {times}")
    return {"attempts": n}


def counted(seconds: float, log: str, ctx: Any = None) -> dict[str, Any]:
    """Append ``<call id> <attempt>`` to ``log`` (one ``O_APPEND`` write: whole lines from many
    processes), then wait ``seconds``: a test counts the runs of each call from the tool's own side."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{ctx.call_id if ctx else '-'} {ctx.attempt if ctx else 0}\n".encode())
    finally:
        os.close(fd)
    time.sleep(seconds)
    return {"slept": seconds}


def lines(path: str | Path) -> list[str]:
    """The lines a back end wrote (none when it was never reached)."""
    p = Path(path)
    return p.read_text(encoding="utf-8").splitlines() if p.exists() else []


def chatty(n: int, until: str, ctx: Any = None) -> dict[str, Any]:
    """Send ``n`` progress messages, then wait for the file ``until`` to exist (a call that stays live)."""
    for i in range(n):
        ctx.progress(f"step {i}")
    while not os.path.exists(until):
        time.sleep(0.02)
    return {"sent": n}
