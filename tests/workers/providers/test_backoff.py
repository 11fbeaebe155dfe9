"""retry_delay and Retry-After parsing."""

from __future__ import annotations

import email.utils

from broker.errors import CallCancelled, ProviderError, ProviderTimeout
from workers.providers.backoff import give_up_reason, is_retryable_status, parse_retry_after, retry_delay

NOW = 1_800_000_000.0


def test_retry_after_in_seconds():
    assert parse_retry_after({"Retry-After": "12"}) == 12.0
    assert parse_retry_after({"retry-after": "1.5"}) == 1.5


def test_retry_after_as_http_date():
    when = email.utils.formatdate(NOW + 30, usegmt=True)
    assert parse_retry_after({"Retry-After": when}, now=NOW) == 30.0


def test_retry_after_in_the_past_means_now():
    when = email.utils.formatdate(NOW - 30, usegmt=True)
    assert parse_retry_after({"Retry-After": when}, now=NOW) == 0.0


def test_retry_after_ms_wins_over_retry_after():
    assert parse_retry_after({"retry-after-ms": "250", "Retry-After": "9"}) == 0.25


def test_missing_or_garbage_retry_after_is_none():
    assert parse_retry_after({}) is None
    assert parse_retry_after({"Retry-After": "soon"}) is None


def test_retryable_statuses():
    assert [s for s in (400, 401, 404, 408, 409, 422, 429, 500, 502, 503, 599) if is_retryable_status(s)] == [
        408,
        429,
        500,
        502,
        503,
        599,
    ]


def test_retry_delay_honours_retry_after():
    err = ProviderError("x", status=429, retry_after=3.0)
    assert retry_delay(err, attempt=1) == 3.0
    assert retry_delay(err, attempt=5) == 3.0


def test_retry_delay_refuses_absurd_waits_with_a_clear_reason():
    err = ProviderError("rate limited", status=429, retry_after=3600.0)
    assert retry_delay(err, attempt=1, max_retry_after=60) is None
    reason = give_up_reason(err, max_retry_after=60)
    assert "3600s" in reason and "60s" in reason and "rate limited" in reason


def test_backoff_is_exponential_with_full_jitter_and_capped():
    err = ProviderError("boom", status=500)
    top = [retry_delay(err, attempt=n, base=0.5, cap=30, rand=lambda: 0.0) for n in range(1, 9)]
    assert top == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert retry_delay(err, attempt=4, rand=lambda: 1.0) == 0.0
    assert retry_delay(err, attempt=4, base=0.5, rand=lambda: 0.5) == 2.0


def test_non_retryable_errors_get_no_delay():
    assert retry_delay(ProviderError("bad", status=400, retryable=False), attempt=1) is None
    assert retry_delay(CallCancelled("x"), attempt=1) is None
    assert retry_delay(ValueError("x"), attempt=1) is None
    assert give_up_reason(ProviderError("bad", status=400, retryable=False)).startswith("not retryable")


def test_timeouts_back_off_like_other_transient_failures():
    assert retry_delay(ProviderTimeout("slow"), attempt=2, base=1.0, rand=lambda: 0.0) == 2.0
