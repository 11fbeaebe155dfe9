"""A python-executor tool for bench/scale_out.py's failover run: it leaves one file per run, so a call
that ran twice shows."""

from __future__ import annotations

import tempfile
import time
from typing import Any


def mark(id: str, dir: str, seconds: float = 0.0, ctx: Any = None) -> str:  # noqa: A002 - the tool's argument names
    """Create ``<dir>/<id>.<random>``, then wait ``seconds``."""
    tempfile.mkstemp(prefix=f"{id}.", dir=dir)
    time.sleep(seconds)
    return id
