"""The execution-middleware failure rules, one test each."""

from __future__ import annotations

from typing import Any

import pytest

from middleware import MiddlewareRegistry, ToolCallFlow
from tests.middleware.helpers import warnings_of


class ToolBroke(Exception):
    pass


class Translated(Exception):
    pass


def run(registry: MiddlewareRegistry, execute: Any) -> Any:
    return ToolCallFlow(registry).run("t", {"a": 1}, execute=execute)


class Counter:
    def __init__(self, result: Any = "result", error: BaseException | None = None) -> None:
        self.calls = 0
        self.result = result
        self.error = error

    def __call__(self, args: Any) -> Any:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.result


def test_raise_before_next_call_is_logged_and_skipped_to_the_next_middleware(
    registry: MiddlewareRegistry, logs: list
) -> None:
    seen: list[str] = []

    def broken(**kw: Any) -> Any:
        raise RuntimeError("before")

    registry.register_middleware("tool_execution", broken)
    registry.register_middleware(
        "tool_execution", lambda **kw: seen.append("second") or kw["next_call"](kw["args"])
    )
    tool = Counter()
    assert run(registry, tool) == "result"
    assert seen == ["second"] and tool.calls == 1
    [warning] = warnings_of(logs)
    assert warning["phase"] == "before next_call"


def test_raise_before_next_call_in_the_last_middleware_falls_through_to_the_base_call(
    registry: MiddlewareRegistry,
) -> None:
    def broken(**kw: Any) -> Any:
        raise KeyError("nope")

    registry.register_middleware("tool_execution", broken)
    tool = Counter()
    assert run(registry, tool) == "result"
    assert tool.calls == 1


def test_raise_after_next_call_keeps_the_downstream_result_and_runs_nothing_twice(
    registry: MiddlewareRegistry, logs: list
) -> None:
    def post_processing_bug(**kw: Any) -> Any:
        kw["next_call"](kw["args"])
        raise ValueError("after")

    registry.register_middleware("tool_execution", post_processing_bug)
    tool = Counter()
    assert run(registry, tool) == "result"
    assert tool.calls == 1
    [warning] = warnings_of(logs)
    assert warning["phase"] == "after next_call"


def test_next_call_is_single_use_and_the_tool_never_runs_twice(
    registry: MiddlewareRegistry, logs: list
) -> None:
    errors: list[BaseException] = []

    def calls_twice(**kw: Any) -> Any:
        first = kw["next_call"](kw["args"])
        try:
            kw["next_call"](kw["args"])
        except RuntimeError as exc:
            errors.append(exc)
            raise
        return first

    registry.register_middleware("tool_execution", calls_twice)
    tool = Counter()
    assert run(registry, tool) == "result"
    assert tool.calls == 1
    assert "more than once" in str(errors[0])


def test_downstream_failure_propagates_unchanged(registry: MiddlewareRegistry, logs: list) -> None:
    registry.register_middleware("tool_execution", lambda **kw: kw["next_call"](kw["args"]))
    registry.register_middleware("tool_execution", lambda **kw: kw["next_call"](kw["args"]))
    error = ToolBroke("backend down")
    tool = Counter(error=error)
    with pytest.raises(ToolBroke) as info:
        run(registry, tool)
    assert info.value is error
    assert tool.calls == 1
    assert warnings_of(logs) == []  # a downstream failure is not a middleware failure


def test_downstream_failure_may_be_translated_on_purpose(registry: MiddlewareRegistry) -> None:
    def translate(**kw: Any) -> Any:
        try:
            return kw["next_call"](kw["args"])
        except ToolBroke as exc:
            raise Translated(str(exc)) from exc

    registry.register_middleware("tool_execution", translate)
    with pytest.raises(Translated, match="backend down"):
        run(registry, Counter(error=ToolBroke("backend down")))


def test_downstream_failure_may_be_translated_into_a_result(registry: MiddlewareRegistry) -> None:
    def fallback(**kw: Any) -> Any:
        try:
            return kw["next_call"](kw["args"])
        except ToolBroke:
            return {"error": "tool unavailable"}

    registry.register_middleware("tool_execution", fallback)
    assert run(registry, Counter(error=ToolBroke())) == {"error": "tool unavailable"}


def test_downstream_failure_is_never_turned_into_a_successful_none(
    registry: MiddlewareRegistry, logs: list
) -> None:
    def swallows(**kw: Any) -> None:
        try:
            kw["next_call"](kw["args"])
        except Exception:
            pass  # forgets to return or re-raise

    registry.register_middleware("tool_execution", swallows)
    error = ToolBroke("backend down")
    with pytest.raises(ToolBroke) as info:
        run(registry, Counter(error=error))
    assert info.value is error
    assert warnings_of(logs)[0]["phase"] == "swallowed downstream error"


def test_retrying_after_a_downstream_failure_propagates_that_failure_not_the_single_use_error(
    registry: MiddlewareRegistry,
) -> None:
    def naive_retry(**kw: Any) -> Any:
        try:
            return kw["next_call"](kw["args"])
        except ToolBroke:
            return kw["next_call"](kw["args"])

    registry.register_middleware("tool_execution", naive_retry)
    tool = Counter(error=ToolBroke("down"))
    with pytest.raises(ToolBroke):
        run(registry, tool)
    assert tool.calls == 1


def test_downstream_failure_below_a_failing_outer_middleware_still_propagates(
    registry: MiddlewareRegistry,
) -> None:
    def outer_bug(**kw: Any) -> Any:
        raise ValueError("outer bug")  # skipped, fail-open

    registry.register_middleware("tool_execution", outer_bug)
    registry.register_middleware("tool_execution", lambda **kw: kw["next_call"](kw["args"]))
    tool = Counter(error=ToolBroke("down"))
    with pytest.raises(ToolBroke):
        run(registry, tool)
    assert tool.calls == 1


def test_llm_execution_follows_the_same_rules(registry: MiddlewareRegistry) -> None:
    def after_bug(**kw: Any) -> Any:
        kw["next_call"](kw["request"])
        raise ValueError("after")

    registry.register_middleware("llm_execution", after_bug)
    calls: list[Any] = []
    rt = registry.runtime()
    response = rt.run_llm_call({"model": "m"}, call_provider=lambda req: calls.append(req) or {"id": 1})
    assert response == {"id": 1} and len(calls) == 1


def test_keyboard_interrupt_in_middleware_is_not_swallowed(registry: MiddlewareRegistry) -> None:
    def interrupted(**kw: Any) -> Any:
        raise KeyboardInterrupt

    registry.register_middleware("tool_execution", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(registry, Counter())


def test_failing_hooks_are_fail_open(registry: MiddlewareRegistry, logs: list) -> None:
    def broken(**kw: Any) -> Any:
        raise ValueError("hook bug")

    for hook in ("pre_tool_call", "post_tool_call", "transform_tool_result"):
        registry.register_hook(hook, broken)
    assert run(registry, Counter()) == "result"
    assert len(warnings_of(logs)) == 3
    assert registry.runtime().emit("pre_tool_call", tool_name="t") == []


STDLIB_ONLY = r'''
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append({"name": record.name, "level": record.levelname, "msg": record.getMessage(),
                        "fields": getattr(record, "hermes", None), "tb": record.exc_info is not None})
root = logging.getLogger()
root.addHandler(Keep())
root.setLevel(logging.DEBUG)
from middleware import MiddlewareRegistry, ToolCallFlow
registry = MiddlewareRegistry()
def broken(**kw):
    raise RuntimeError("boom")
registry.register_middleware("tool_execution", broken)
for _ in range(3):
    assert ToolCallFlow(registry).run("t", {"a": 1}, execute=lambda args: "ok") == "ok"
sys.stderr.write(json.dumps(records))
'''


def test_a_program_that_never_configured_structlog_gets_the_warn_once_as_stdlib_records() -> None:
    # Hermes logs through `logging`: a host that only imports this package sees one WARNING record on
    # hermes.middleware (with its traceback and fields), then DEBUG repeats, and nothing on stdout.
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", STDLIB_ONLY], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    records = [r for r in json.loads(out.stderr) if r["name"] == "hermes.middleware" and "boom" in r["msg"]]
    assert [r["level"] for r in records] == ["WARNING", "DEBUG", "DEBUG"]
    first = records[0]
    assert first["tb"] and "tool_execution callback" in first["msg"] and "it is given: " in first["msg"]
    assert first["fields"]["error_type"] == "RuntimeError" and first["fields"]["repeated"] is False
    assert records[1]["fields"]["repeated"] is True


def test_what_a_middleware_changed_in_place_before_it_failed_goes_with_it(registry: MiddlewareRegistry) -> None:
    """The contract: a middleware that raises before next_call is skipped, and the chain goes on with the
    payload it was given — not with the half-made edit it left in place (which no policy check had seen)."""
    def half_done(**kw: Any) -> Any:
        kw["args"]["half_done"] = True
        raise ValueError("oops")

    seen: list[Any] = []
    registry.register_middleware("tool_execution", half_done)
    registry.register_middleware("tool_execution", lambda **kw: seen.append(dict(kw["args"])) or kw["next_call"]())
    ran: list[Any] = []
    assert run(registry, lambda args: ran.append(args) or "result") == "result"
    assert seen == [{"a": 1}] and ran == [{"a": 1}]


def test_a_request_middleware_returning_a_wrong_shape_is_said_once_and_ignored(
    registry: MiddlewareRegistry, logs: list
) -> None:
    registry.register_middleware("tool_request", lambda **kw: {"arguments": {"a": 2}})  # (a typo of "args")
    registry.register_middleware("tool_request", lambda **kw: None)  # (no change: nothing to say)
    ran: list[Any] = []
    for _ in range(2):
        run(registry, lambda args: ran.append(args) or "result")
    assert ran == [{"a": 1}, {"a": 1}]
    [warning] = warnings_of(logs)
    assert "returned a dict without 'args'" in str(warning) and warning["phase"] == "its return"
