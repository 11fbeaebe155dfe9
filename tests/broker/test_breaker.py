"""Circuit breakers in Redis: consecutive and error-rate rules, one probe when half-open, close / re-open."""

from __future__ import annotations

import time
from typing import Any

import pytest

from broker import keys
from broker.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, Breakers, rejecting


@pytest.fixture
def br(fake: Any) -> Breakers:
    return Breakers(fake)


def cfg(**kw: Any) -> BreakerConfig:
    return BreakerConfig.of(kw, "tool:api")


def fail(br: Breakers, c: BreakerConfig, call: str = "x", etype: str = "executor_error") -> Any:
    return br.record(c, call, "fail", etype)


def cool_down(fake: Any, key: str = "tool:api") -> None:
    """Pretend the cooldown is over (no sleeping in unit tests)."""
    fake.hset(keys.breaker(key), "opened_at", time.time() - 3600)


def test_consecutive_failures_open_it_and_a_success_resets_the_count(br: Breakers) -> None:
    c = cfg(failures=3, cooldown=30)
    assert fail(br, c) is None and fail(br, c) is None
    assert br.record(c, "ok-call", "ok") is None  # resets
    assert fail(br, c) is None and fail(br, c) is None
    change = fail(br, c, "third")
    assert (change.previous, change.state, change.call_id) == (CLOSED, OPEN, "third")
    assert "3 consecutive failures" in change.reason
    decision = br.check(c, "next", probe_ttl=10)
    assert not decision.allowed and decision.retry_at == pytest.approx(time.time() + 30, abs=2)
    assert br.state("tool:api")["state"] == OPEN and rejecting(br.state("tool:api"), 30)


def test_neutral_outcomes_neither_count_nor_reset(br: Breakers) -> None:
    c = cfg(failures=2)
    fail(br, c)
    assert br.record(c, "bad-args", "neutral") is None
    assert fail(br, c).state == OPEN


def test_the_error_rate_rule_needs_its_minimum_of_calls(br: Breakers) -> None:
    c = cfg(rate=0.5, window=60, min_calls=10)
    assert c.failures == 0  # only the rate rule is on
    for i in range(4):
        assert br.record(c, f"ok{i}", "ok") is None
    for i in range(5):
        assert fail(br, c, f"f{i}") is None  # 5 of 9: over the rate, under the minimum
    change = fail(br, c, "tenth")
    assert change.state == OPEN and "6 of 10 calls failed" in change.reason


def test_after_the_cooldown_exactly_one_probe_goes_through(br: Breakers, fake: Any) -> None:
    c = cfg(failures=1, cooldown=30)
    fail(br, c)
    cool_down(fake)
    first = br.check(c, "probe", probe_ttl=10)
    assert first.allowed and first.probe
    assert (first.change.previous, first.change.state) == (OPEN, HALF_OPEN)
    for other in ("a", "b", "c"):
        assert not br.check(c, other, probe_ttl=10).allowed
    # Outcomes of calls that are not the probe have no say while half-open.
    assert br.record(c, "a", "ok") is None and br.state("tool:api")["state"] == HALF_OPEN
    change = br.record(c, "probe", "ok")
    assert (change.previous, change.state) == (HALF_OPEN, CLOSED)
    assert br.check(c, "after", probe_ttl=10).allowed


def test_a_failed_probe_opens_it_again_for_another_cooldown(br: Breakers, fake: Any) -> None:
    c = cfg(failures=1, cooldown=30)
    fail(br, c)
    cool_down(fake)
    assert br.check(c, "probe", probe_ttl=10).probe
    change = fail(br, c, "probe")
    assert (change.previous, change.state, change.reason) == (HALF_OPEN, OPEN, "probe failed")
    assert not br.check(c, "next", probe_ttl=10).allowed


def test_a_probe_that_never_reports_is_replaced_after_its_deadline(br: Breakers, fake: Any) -> None:
    c = cfg(failures=1, cooldown=30)
    fail(br, c)
    cool_down(fake)
    assert br.check(c, "lost-probe", probe_ttl=10).probe
    assert not br.check(c, "b", probe_ttl=10).allowed
    fake.hset(keys.breaker("tool:api"), "probe_until", time.time() - 1)  # its worker died
    assert br.check(c, "b", probe_ttl=10).probe
    # A neutral probe (cancelled) frees the half-open slot for the next caller.
    assert br.record(c, "b", "neutral") is None
    assert br.check(c, "c", probe_ttl=10).probe


def test_which_errors_count_is_configurable(br: Breakers) -> None:
    assert cfg().counts("tool_timeout") and cfg().counts("executor_error")
    assert not cfg().counts("invalid_args") and not cfg().counts("permission_denied")
    assert not cfg().counts("cancelled")
    only = cfg(on=["tool_timeout"])
    assert only.counts("tool_timeout") and not only.counts("executor_error")
    assert BreakerConfig.of({"key": "shared-db"}, "tool:x").key == "shared-db"


def test_breakers_are_listed_for_status(br: Breakers, fake: Any) -> None:
    c = cfg(failures=1)
    fail(br, c)
    fail(br, cfg(failures=5, key="other"), "y")
    states = {b["key"]: b["state"] for b in br.all()}
    assert states == {"tool:api": OPEN}  # a breaker shows once it has changed state
    br.reset("tool:api")
    assert br.all() == [] and br.state("tool:api")["state"] == CLOSED
