"""When to try a failed provider call again: Retry-After first, else exponential backoff with full jitter
(the tool retries' formula, ``RetryPolicy.delay``, with ``jitter`` 1)."""

from __future__ import annotations

import email.utils
import random
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from workers.retry import RetryPolicy

RETRYABLE_STATUSES: frozenset[int] = frozenset({408, 429})
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "h": 3600.0, "m": 60.0, "s": 1.0}


def is_retryable_status(status: int) -> bool:
    """429, 408 and every 5xx are worth another attempt; other statuses will fail the same way again."""
    return status in RETRYABLE_STATUSES or 500 <= status <= 599


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (delta-seconds or an HTTP-date)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    if raw_ms := lowered.get("retry-after-ms"):
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = (lowered.get("retry-after") or "").strip()
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def parse_reset(value: str) -> float | None:
    """Seconds of an ``x-ratelimit-reset-*`` header: ``1s``, ``6m0s``, ``250ms``, ``1h2m3.5s`` or a number."""
    text = value.strip().lower()
    if not text:
        return None
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNITS[u] for n, u in parts)


def pause_seconds(headers: Mapping[str, str]) -> float | None:
    """How long a 429/503 asks the fleet to wait: ``retry-after-ms``, ``Retry-After``, else the longest
    ``x-ratelimit-reset-requests`` / ``-tokens`` whose remaining count is 0 (or either, when none says)."""
    if (from_retry := parse_retry_after(headers)) is not None:
        return from_retry
    lowered = {k.lower(): v for k, v in headers.items()}
    waits = []
    for kind in ("requests", "tokens"):
        reset = parse_reset(lowered.get(f"x-ratelimit-reset-{kind}", ""))
        if reset is not None and lowered.get(f"x-ratelimit-remaining-{kind}", "0").strip() in ("0", ""):
            waits.append(reset)
    return max(waits) if waits else None


def retry_delay(
    error: BaseException,
    attempt: int,
    base: float = 0.5,
    cap: float = 30.0,
    max_retry_after: float = 60.0,
    rand: Callable[[], float] = random.random,
) -> float | None:
    """Seconds before the attempt after ``attempt`` (1-based), or None to give up (not retryable, or the
    server asks for a longer wait than ``max_retry_after``)."""
    if not getattr(error, "retryable", False):
        return None
    retry_after: Any = getattr(error, "retry_after", None)
    if retry_after is not None:
        wait = float(retry_after)
        return None if wait > max_retry_after else wait
    return RetryPolicy(backoff=base, max_backoff=cap, jitter=1.0).delay(attempt, rand)


def give_up_reason(error: BaseException, max_retry_after: float = 60.0) -> str:
    """A sentence saying why ``retry_delay`` returned None for this error."""
    retry_after = getattr(error, "retry_after", None)
    if getattr(error, "retryable", False) and retry_after is not None and retry_after > max_retry_after:
        return (
            f"provider asked to retry after {retry_after:g}s, more than the {max_retry_after:g}s "
            f"this gateway waits; giving up: {error}"
        )
    return f"not retryable: {error}"
