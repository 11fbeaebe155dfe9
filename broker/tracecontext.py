"""W3C trace context: parse and mint ``traceparent`` headers."""

from __future__ import annotations

import os
import random
import re

# Ids need to be unique, not secret: a PRNG seeded from the OS (and reseeded in a forked child) is enough,
# and os.urandom is a system call that costs tens of microseconds per id on some virtual machines.
_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)

_TP = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """Return ``(trace_id, span_id)`` of a valid traceparent, else None."""
    if not value:
        return None
    m = _TP.match(value.strip().lower())
    if not m or m.group(1) == "ff" or set(m.group(2)) == {"0"} or set(m.group(3)) == {"0"}:
        return None
    return m.group(2), m.group(3)


def random_hex(nbytes: int) -> str:
    """``nbytes`` random bytes as hex, never all zeros (W3C forbids zero ids)."""
    return f"{_rng.getrandbits(nbytes * 8) or 1:0{nbytes * 2}x}"


def new_trace_id() -> str:
    return random_hex(16)


def new_span_id() -> str:
    return random_hex(8)


def make_traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def ensure_traceparent(value: str | None) -> str:
    """The caller's traceparent when valid, else the start of a new trace."""
    if parse_traceparent(value):
        return value.strip().lower()  # type: ignore[union-attr]
    return make_traceparent(new_trace_id(), new_span_id())
