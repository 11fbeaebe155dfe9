"""A python tool for the batch tests: each run appends its item's index to ``<path>`` (one line per run, so
a test counts how often each item really ran), sleeps ``seconds`` and returns ``{"i": i, "twice": 2 * i}``."""

from __future__ import annotations

import os
import time


def mark(i: int, path: str, seconds: float = 0.0) -> dict:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{i}\n".encode())
    finally:
        os.close(fd)
    if seconds:
        time.sleep(seconds)
    return {"i": i, "twice": 2 * i}
