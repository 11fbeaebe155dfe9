"""W3C trace context: parse and mint ``traceparent`` headers."""

from __future__ import annotations

import os
import re

_TP = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """Return ``(trace_id, span_id)`` of a valid traceparent, else None."""
    if not value:
        return None
    m = _TP.match(value.strip().lower())
    if not m or m.group(1) == "ff" or set(m.group(2)) == {"0"} or set(m.group(3)) == {"0"}:
        return None
    return m.group(2), m.group(3)


def new_trace_id() -> str:
    return os.urandom(16).hex()


def new_span_id() -> str:
    return os.urandom(8).hex()


def make_traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def ensure_traceparent(value: str | None) -> str:
    """The caller's traceparent when valid, else the start of a new trace."""
    if parse_traceparent(value):
        return value.strip().lower()  # type: ignore[union-attr]
    return make_traceparent(new_trace_id(), new_span_id())
