"""Retries: the backoff schedule and its jitter bounds, which errors retry, and the scheduler on fakeredis."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from broker import events, keys
from broker.calls import Calls
from broker.config import Settings, WorkerSettings
from broker.directory import Directory
from broker.envelope import Envelope, Options
from broker.errors import CallFailed, ExecutorError, InvalidArgs, ToolTimeout
from tests.conftest import heard
from workers.retry import RetryPolicy
from workers.runner import CallRunner, WorkerCore
from workers.specs import check_spec

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_backoff_is_exponential_and_capped() -> None:
    p = RetryPolicy.of({"max": 10, "backoff": 0.5, "max_backoff": 5, "jitter": 0})
    assert [p.base_delay(a) for a in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert [p.delay(a) for a in (1, 2, 3)] == [0.5, 1.0, 2.0]


@pytest.mark.parametrize("jitter", [0.2, 0.5, 1.0, True])
def test_jitter_stays_within_its_bounds(jitter: Any) -> None:
    p = RetryPolicy.of({"max": 5, "backoff": 1.0, "max_backoff": 30, "jitter": jitter})
    frac = 1.0 if jitter is True else jitter
    for attempt in (1, 2, 3, 4):
        base = p.base_delay(attempt)
        assert p.delay(attempt, rand=lambda: 0.0) == base  # never above the backoff
        assert p.delay(attempt, rand=lambda: 0.999999) == pytest.approx(base * (1 - frac), abs=1e-5)
        for _ in range(200):
            assert base * (1 - frac) - 1e-9 <= p.delay(attempt) <= base


def test_which_errors_are_retried() -> None:
    default = RetryPolicy.of({"max": 2})
    assert default.applies(ExecutorError("down")) and default.applies(ToolTimeout("slow"))
    assert not default.applies(InvalidArgs("bad")) and not default.applies(
        CallFailed("x", error_type="permission_denied")
    )
    listed = RetryPolicy.of({"max": 2, "on": ["tool_timeout"]})
    assert listed.applies(ToolTimeout("slow")) and not listed.applies(ExecutorError("down"))
    assert RetryPolicy.of({"on": "executor_error"}).on == frozenset({"executor_error"})


# -- on a worker core (fakeredis) ----------------------------------------------------------------


@pytest.fixture
def core(fake: Any, tmp_path: Path) -> Any:
    Directory(fake).register(
        check_spec(
            {
                "name": "flaky",
                "executor": "python",
                "function": "tests.e2e.flowtools:fail_times",
                "timeout": 5,
                "retry": {"max": 2, "backoff": 10, "jitter": 0},
            }
        )
    )
    c = WorkerCore(fake, Settings(home=tmp_path, workers=WorkerSettings(lease=5.0, result_ttl=600)), "w-test")
    c.scheduler.queues = ["tools"]  # (a Worker sets its queues)
    yield c
    c.close()


def _submit(fake: Any, call_id: str, max_attempts: int | None = None, **args: Any) -> None:
    heard(fake)  # (listening as the caller does: an ended call's history is its last event alone)
    env = Envelope(
        call_id=call_id,
        kind="tool",
        tool="flaky",
        args=args,
        traceparent=TP,
        channel="hermes:ch:t",
        options=Options(max_attempts=max_attempts),
    )
    Calls(fake).submit(env, ckey="tool:flaky", queue_size=-1, max_attempts=3, timeout=5, concurrency=1)


def _run(core: WorkerCore) -> int:
    claimed = core.calls.claim(["tools"], 10, core.name, 5.0)
    for c in claimed:
        CallRunner(core).run(c)
    assert core.outbox.flush(5)
    return len(claimed)


def _transitions(fake: Any, cid: str) -> list[tuple[str, int]]:
    return [(e.state, e.attempt) for e in heard(fake).events(cid) if e.type == events.TRANSITION]


def test_a_failed_attempt_waits_on_the_schedule_without_its_slot_then_comes_back(
    fake: Any, core: WorkerCore, tmp_path: Path
) -> None:
    counter = str(tmp_path / "n")
    _submit(fake, "c1", counter=counter, times=1)
    _submit(fake, "c2", counter=str(tmp_path / "other"), times=0)
    before = time.time()
    assert _run(core) == 1
    hist = events.history(fake, "c1")
    retrying = hist[-1]
    assert (retrying.state, retrying.detail["next_attempt"], retrying.detail["delay"]) == (
        "retrying",
        2,
        10.0,
    )
    assert before + 10 <= retrying.detail["next_attempt_at"] <= time.time() + 10
    assert fake.zscore(keys.scheduled("{tools}"), "c1") == pytest.approx(retrying.detail["next_attempt_at"])
    # Its slot went to the next call while it waits.
    assert fake.zscore(keys.slots("{tools}", "tool:flaky"), "c1") is None
    assert _run(core) == 1
    assert _transitions(fake, "c2")[-1] == ("done", 1)
    # Not due yet: the scheduler leaves it; once due, back to pending and through admission.
    assert core.scheduler.run_once()[0] == 0
    fake.zadd(keys.scheduled("{tools}"), {"c1": time.time() - 1})
    assert core.scheduler.run_once()[0] == 1
    assert _run(core) == 1
    assert _transitions(fake, "c1") == [
        ("pending", 1),
        ("routing", 1),
        ("executing", 1),
        ("retrying", 1),
        ("pending", 2),
        ("routing", 2),
        ("executing", 2),
        ("formatting", 2),
        ("done", 2),
    ]
    assert fake.zcard(keys.scheduled("{tools}")) == 0 and fake.zcard(keys.slots("{tools}", "tool:flaky")) == 0


def test_no_retry_past_max_or_the_callers_max_attempts(fake: Any, core: WorkerCore, tmp_path: Path) -> None:
    _submit(fake, "c1", max_attempts=1, counter=str(tmp_path / "a"), times=5)
    _run(core)
    assert _transitions(fake, "c1")[-1] == ("failed", 1)
    _submit(fake, "c2", counter=str(tmp_path / "b"), times=5)
    for _ in range(3):
        _run(core)
        fake.zadd(keys.scheduled("{tools}"), {"c2": time.time() - 1})
        core.scheduler.run_once()
    states = _transitions(fake, "c2")
    assert [s for s, _ in states].count("retrying") == 2  # max: 2 retries after the first attempt
    assert states[-1] == ("failed", 3)
