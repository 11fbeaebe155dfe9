"""The python executor ends a call at its deadline or on cancel even when the function ignores ``ctx``.

Real threads throughout: functions without ``ctx`` run on helper threads, get ``ToolStopped`` injected
when abandoned, and abandoned ones are capped per tool (``max_abandoned``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from broker.errors import CallCancelled, ExecutorError, ToolTimeout
from broker.toolspec import ToolSpec
from tests.conftest import wait_until
from workers.executors import python as pyexec
from workers.specs import check_spec

from . import stoppable

MOD = "tests.workers.executors.stoppable"


def spec(function: str, name: str = "t") -> ToolSpec:
    return check_spec({"name": name, "executor": "python", "function": f"{MOD}:{function}"})


@pytest.fixture
def ex():
    executor = pyexec.PythonExecutor({})
    yield executor
    executor.close()


def timed(fn, *args: Any) -> tuple[float, BaseException | None]:
    start = time.monotonic()
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - the test looks at it
        return time.monotonic() - start, e
    return time.monotonic() - start, None


def test_blocked_sync_function_times_out_at_the_deadline(ex, make_ctx):
    took, err = timed(ex.run, spec("sleeper", "s1"), {"seconds": 1.5, "tag": "s1"}, make_ctx(timeout=0.3))
    assert isinstance(err, ToolTimeout) and err.to_wire()["type"] == "tool_timeout"
    assert 0.25 < took < 0.6
    # The sleep cannot be interrupted in C, but once it returns the injected ToolStopped ends the function.
    wait_until(lambda: "ToolStopped" in stoppable.events.get("s1", []), timeout=5)
    assert "after-sleep" not in stoppable.events["s1"]
    wait_until(lambda: ex._tallies["s1"].count == 0, timeout=5)


def test_pure_python_loop_is_stopped(ex, make_ctx):
    took, err = timed(ex.run, spec("spinner", "s2"), {"tag": "s2", "limit": 20}, make_ctx(timeout=0.3))
    assert isinstance(err, ToolTimeout) and took < 0.6
    wait_until(lambda: "ToolStopped" in stoppable.events.get("s2", []), timeout=2)
    seen = stoppable.counters["s2"]
    time.sleep(0.2)  # a negative check: a short bounded wait in which a loop that was not stopped would count on
    assert stoppable.counters["s2"] == seen  # it stopped counting (its `except Exception` did not help)
    assert "ran-out" not in stoppable.events["s2"]
    assert ex._tallies["s2"].count == 0


def test_cancel_ends_the_call_at_once(ex, make_ctx):
    ctx = make_ctx(timeout=30)
    threading.Timer(0.2, ctx.cancelled.set).start()
    took, err = timed(ex.run, spec("sleeper", "s3"), {"seconds": 1.0, "tag": "s3"}, ctx)
    assert isinstance(err, CallCancelled)
    assert took < 0.5
    wait_until(lambda: "ToolStopped" in stoppable.events.get("s3", []), timeout=5)


def test_cancel_stops_a_busy_loop(ex, make_ctx):
    ctx = make_ctx(timeout=30)
    threading.Timer(0.2, ctx.cancelled.set).start()
    took, err = timed(ex.run, spec("spinner", "s4"), {"tag": "s4", "limit": 20}, ctx)
    assert isinstance(err, CallCancelled) and took < 0.5
    wait_until(lambda: "ToolStopped" in stoppable.events.get("s4", []), timeout=2)


def test_async_function_without_ctx_is_cancelled(ex, make_ctx):
    took, err = timed(ex.run, spec("asleeper", "s5"), {"seconds": 20, "tag": "s5"}, make_ctx(timeout=0.3))
    assert isinstance(err, ToolTimeout) and took < 0.6
    wait_until(lambda: "CancelledError" in stoppable.events.get("s5", []), timeout=2)
    assert "finished" not in stoppable.events["s5"]
    wait_until(lambda: ex._tallies["s5"].count == 0, timeout=5)


def test_an_async_functions_job_gets_no_toolstopped_its_loop_stops_it(ex, make_ctx):
    """The loop running an async function cancels its task at the deadline itself; a ToolStopped injected as
    well landed wherever the helper was, the loop or the coroutine's own cleanup, and cut that short (a
    flaky end-to-end test under load lost the coroutine's CancelledError note that way)."""
    from workers.executors.pyhelpers import Job, Tally

    started, release = threading.Event(), threading.Event()

    def body() -> None:
        job.cooperate()  # (what _call does once the function returned a coroutine)
        started.set()
        release.wait(5)

    job = Job(body, Tally())
    helper = threading.Thread(target=lambda: (job.begin(threading.get_ident()), job.execute(), job.settle()))
    helper.start()
    assert started.wait(5)
    job.stop()  # the call thread gives up on it
    release.set()
    helper.join(5)
    assert not job.injected and job.error is None  # nothing was thrown into the helper
    took, err = timed(ex.run, spec("atidy", "s5t"), {"seconds": 20, "tag": "s5t", "tidy": 0.2}, make_ctx(timeout=0.3))
    assert isinstance(err, ToolTimeout) and took < 0.6
    wait_until(lambda: "tidied" in stoppable.events.get("s5t", []), timeout=3, message="the cleanup to end")


def test_an_async_function_that_never_awaits_is_stopped_after_the_grace(ex, make_ctx):
    """Its loop cannot cancel a coroutine that never yields: the ToolStopped comes after COOPERATION_GRACE."""
    from workers.executors.pyhelpers import COOPERATION_GRACE

    took, err = timed(ex.run, spec("aspinner", "s5s"), {"tag": "s5s", "limit": 20}, make_ctx(timeout=0.3))
    assert isinstance(err, ToolTimeout) and took < 0.6
    wait_until(lambda: "ToolStopped" in stoppable.events.get("s5s", []), timeout=COOPERATION_GRACE + 3)
    assert "ran-out" not in stoppable.events["s5s"]
    wait_until(lambda: ex._tallies["s5s"].count == 0, timeout=5)


def test_async_function_without_ctx_returns_its_result(ex, make_ctx):
    assert ex.run(spec("asleeper", "s5b"), {"seconds": 0.01, "tag": "s5b"}, make_ctx()) == "finished"


def test_an_abandoned_function_does_not_hold_up_the_next_call(ex, make_ctx):
    sp = spec("sleeper", "s6")
    with pytest.raises(ToolTimeout):
        ex.run(sp, {"seconds": 1.5, "tag": "s6a"}, make_ctx(timeout=0.2))
    start = time.monotonic()
    assert ex.run(sp, {"seconds": 0.05, "tag": "s6b"}, make_ctx()) == {"slept": 0.05, "tag": "s6b"}
    assert time.monotonic() - start < 0.5
    assert ex._tallies["s6"].count == 1  # the first one is still asleep on its helper
    wait_until(lambda: ex._tallies["s6"].count == 0, timeout=5)


def test_abandoned_functions_are_capped_per_tool(make_ctx):
    ex = pyexec.PythonExecutor({"max_abandoned": 2})
    try:
        _capped_per_tool(ex, make_ctx)
    finally:
        ex.close()


def _capped_per_tool(ex, make_ctx):
    capped = spec("sleeper", "s7")
    for i in range(2):
        with pytest.raises(ToolTimeout):
            ex.run(capped, {"seconds": 1.0, "tag": f"s7-{i}"}, make_ctx(timeout=0.1))
    took, err = timed(ex.run, capped, {"seconds": 0.01}, make_ctx())
    assert isinstance(err, ExecutorError) and "max_abandoned 2" in str(err) and took < 0.05
    assert err.to_wire()["type"] == "executor_error"
    # Other tools are not affected, and the tool works again once its abandoned calls have ended.
    assert ex.run(spec("nothing", "s7-other"), {}, make_ctx()) is None
    wait_until(lambda: ex._tallies["s7"].count == 0, timeout=5)
    assert ex.run(capped, {"seconds": 0.01}, make_ctx()) == {"slept": 0.01, "tag": ""}


def test_the_cap_comes_from_settings_too(make_ctx):
    ex = pyexec.PythonExecutor({"max_abandoned": 0})
    try:
        with pytest.raises(ExecutorError, match="max_abandoned 0"):
            ex.run(spec("nothing", "s8"), {}, make_ctx())
    finally:
        ex.close()


def test_functions_with_ctx_still_run_on_the_call_thread(ex, make_ctx):
    out = ex.run(spec("whoami_ctx"), {}, make_ctx())
    assert out == {"thread": threading.get_ident(), "call_id": "c-test"}


def test_helpers_are_reused_and_see_the_callers_context(ex, make_ctx):
    token = stoppable.request_id.set("r-42")
    try:
        seen = {ex.run(spec("whoami"), {}, make_ctx())["thread"] for _ in range(20)}
        assert ex.run(spec("whoami"), {}, make_ctx())["request_id"] == "r-42"
    finally:
        stoppable.request_id.reset(token)
    assert threading.get_ident() not in seen
    assert len(seen) == 1  # one call at a time: one helper, reused


def test_errors_of_helper_run_functions_are_executor_errors(ex, make_ctx):
    with pytest.raises(ExecutorError, match="KeyError"):
        ex.run(spec("boom"), {}, make_ctx())


def test_deadline_races_leave_no_stray_stop_behind(ex, make_ctx):
    """Functions that end right around the deadline: a ToolStopped must never surface later."""
    sp = spec("sleeper", "s9")
    for i in range(60):
        try:
            ex.run(sp, {"seconds": 0.02, "tag": "race"}, make_ctx(timeout=0.02 + (i % 5) * 0.001))
        except ToolTimeout:
            pass
    wait_until(lambda: ex._tallies["s9"].count == 0, timeout=5)
    # The helpers are healthy: quick calls on them all succeed, none gets a late ToolStopped.
    results: list[Any] = []

    def many() -> None:
        for _ in range(50):
            results.append(ex.run(spec("nothing"), {}, make_ctx()))

    threads = [threading.Thread(target=many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [None] * 200


def test_close_ends_idle_helpers(make_ctx):
    ex = pyexec.PythonExecutor({})
    ex.run(spec("nothing"), {}, make_ctx())
    helpers = [h.thread for h in ex._helpers.idle]
    ex.close()
    assert len(helpers) == 1
    wait_until(lambda: not helpers[0].is_alive(), timeout=5)


def test_functions_listed_inline_run_on_the_call_thread(make_ctx):
    ex = pyexec.PythonExecutor({"inline": [f"{MOD}.whoami"]})  # either spelling of the reference
    try:
        assert ex.run(spec("whoami"), {}, make_ctx())["thread"] == threading.get_ident()
        assert ex.run(spec("nothing"), {}, make_ctx()) is None  # not listed: on a helper
        assert len(ex._helpers.idle) == 1
    finally:
        ex.close()
