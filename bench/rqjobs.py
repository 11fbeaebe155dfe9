"""The stock-RQ side's job functions: the same work as our tools, in a module that imports nothing heavy.

``rq worker-pool`` forks a work horse per job, and the horse imports the job's module afresh; a job
function living in our package would make every RQ job pay our imports (~0.1 s), not RQ's own cost.
"""

from __future__ import annotations

import time


def sleep(seconds: float = 0.0) -> dict[str, float]:
    """Wait ``seconds``, like ``workers.executors.builtin:sleep``."""
    time.sleep(seconds)
    return {"slept": seconds}


def noop() -> None:
    """Nothing, like ``workers.executors.builtin:noop``."""


def noop_text(text: str) -> None:
    """Nothing, with arguments (``bench/memory.py``'s 100 bytes)."""
