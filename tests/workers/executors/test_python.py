"""The python executor: import once, call with **args (+ctx), async with deadline and cancellation."""

from __future__ import annotations

import threading

import pytest

from broker.errors import CallCancelled, ExecutorError, InvalidArgs, InvalidSpec, ToolTimeout
from broker.toolspec import ToolSpec
from workers.executors import python as pyexec
from workers.specs import check_spec

MOD = "tests.workers.executors.pyfuncs"


def spec(function: str) -> ToolSpec:
    return check_spec({"name": "t", "executor": "python", "function": function})


@pytest.fixture
def ex() -> pyexec.PythonExecutor:
    return pyexec.PythonExecutor({})


def test_sync_function_gets_kwargs(ex, make_ctx):
    assert ex.run(spec(f"{MOD}:add"), {"a": 2, "b": 5}, make_ctx()) == 7


def test_dotted_reference_also_resolves(ex, make_ctx):
    assert ex.run(spec(f"{MOD}.add"), {"a": 2}, make_ctx()) == 3


def test_ctx_parameter_receives_context_and_progress(ex, make_ctx):
    ctx = make_ctx()
    assert ex.run(spec(f"{MOD}:with_progress"), {"n": 3}, ctx) == {"n": 3, "call_id": "c-test"}
    assert ctx.messages == ["counting to 3"]


def test_model_cannot_pass_ctx(ex, make_ctx):
    with pytest.raises(InvalidArgs, match="reserved"):
        ex.run(spec(f"{MOD}:with_progress"), {"n": 3, "ctx": "x"}, make_ctx())


def test_unexpected_argument_is_invalid_args(ex, make_ctx):
    with pytest.raises(InvalidArgs, match="unexpected keyword"):
        ex.run(spec(f"{MOD}:add"), {"a": 1, "zzz": 2}, make_ctx())


def test_a_missing_argument_is_invalid_args_and_defaults_fill_in(ex, make_ctx):
    with pytest.raises(InvalidArgs, match="missing a required argument: 'a'"):
        ex.run(spec(f"{MOD}:add"), {"b": 2}, make_ctx())
    assert ex.run(spec(f"{MOD}:add"), {"a": 2}, make_ctx()) == 3  # b defaults to 1
    assert ex.run(spec(f"{MOD}:add"), {"b": 5, "a": 1}, make_ctx()) == 6


def test_a_function_with_var_keywords_takes_any_name_but_still_needs_its_required_ones(ex, make_ctx):
    assert ex.run(spec(f"{MOD}:tagged"), {"name": "x", "colour": "red"}, make_ctx()) == {"name": "x", "colour": "red"}
    with pytest.raises(InvalidArgs, match="missing a required argument: 'name'"):
        ex.run(spec(f"{MOD}:tagged"), {"colour": "red"}, make_ctx())
    with pytest.raises(InvalidArgs, match="positional"):  # (bound: a positional-only parameter cannot be named)
        ex.run(spec(f"{MOD}:positional_only"), {"a": 1}, make_ctx())


def test_exception_becomes_executor_error_with_type_and_message(ex, make_ctx):
    with pytest.raises(ExecutorError, match="ValueError: kaboom"):
        ex.run(spec(f"{MOD}:explode"), {"message": "kaboom"}, make_ctx())


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "helper_thread"])
def test_sys_exit_and_keyboard_interrupt_from_a_tool_are_its_failure_not_the_workers(make_ctx, inline):
    """SystemExit (sys.exit, argparse's error on a hostile argument) passed ``except Exception``: it left
    the call thread, the call hung, and a lease later the tool ran again."""
    functions = [f"{MOD}:{f}" for f in ("exits", "interrupted", "unprintable")]
    ex = pyexec.PythonExecutor({"inline": functions} if inline else {})

    def run(function: str, args: dict) -> None:
        assert ex.resolve(f"{MOD}:{function}", "t").inline is inline
        ex.run(spec(f"{MOD}:{function}"), args, make_ctx())

    with pytest.raises(ExecutorError, match="SystemExit: 2") as info:
        run("exits", {"code": 2})
    assert info.value.details["exception"] == "SystemExit"
    with pytest.raises(ExecutorError, match="KeyboardInterrupt: tool code raised it"):
        run("interrupted", {})
    with pytest.raises(ExecutorError, match="_Unprintable: <_Unprintable whose message cannot be read>"):
        run("unprintable", {})


def test_gateway_errors_pass_through(ex, make_ctx):
    with pytest.raises(InvalidArgs, match="bad city"):
        ex.run(spec(f"{MOD}:typed_failure"), {}, make_ctx())


def test_non_serialisable_result_is_executor_error(ex, make_ctx):
    with pytest.raises(ExecutorError, match=r"\$\.when is a datetime"):
        ex.run(spec(f"{MOD}:not_serialisable"), {}, make_ctx())


def test_async_function_runs_and_tuples_become_lists(ex, make_ctx):
    assert ex.run(spec(f"{MOD}:aadd"), {"a": 1, "b": 2}, make_ctx()) == {"sum": 3, "pair": [1, 2]}


def test_async_function_is_stopped_at_deadline(ex, make_ctx):
    with pytest.raises(ToolTimeout):
        ex.run(spec(f"{MOD}:aslow"), {"seconds": 30}, make_ctx(timeout=0.3))


def test_async_function_is_cancelled(ex, make_ctx):
    ctx = make_ctx(timeout=30)
    threading.Timer(0.2, ctx.cancelled.set).start()
    with pytest.raises(CallCancelled):
        ex.run(spec(f"{MOD}:aslow"), {"seconds": 30}, ctx)


def test_builtin_sleep_is_cancellable(ex, make_ctx):
    ctx = make_ctx(timeout=30)
    threading.Timer(0.2, ctx.cancelled.set).start()
    with pytest.raises(CallCancelled):
        ex.run(spec("workers.executors.builtin:sleep"), {"seconds": 30}, ctx)


def test_builtin_sleep_times_out(ex, make_ctx):
    with pytest.raises(ToolTimeout):
        ex.run(spec("workers.executors.builtin:sleep"), {"seconds": 30}, make_ctx(timeout=0.2))


def test_builtin_noop_and_echo(ex, make_ctx):
    assert ex.run(spec("workers.executors.builtin:noop"), {"x": 1}, make_ctx()) is None
    assert ex.run(spec("workers.executors.builtin:echo"), {"x": [1, b"b"]}, make_ctx()) == {"x": [1, b"b"]}


def test_bad_reference_is_spec_error(ex, make_ctx):
    with pytest.raises(InvalidSpec, match="cannot import"):
        ex.run(spec("no_such_module_xyz:f"), {}, make_ctx())
    with pytest.raises(InvalidSpec, match="has no"):
        ex.run(spec(f"{MOD}:missing"), {}, make_ctx())


def test_cancelled_before_start_does_not_call(ex, make_ctx):
    ctx = make_ctx()
    ctx.cancelled.set()
    with pytest.raises(CallCancelled):
        ex.run(spec(f"{MOD}:explode"), {"message": "should not run"}, ctx)


def test_a_result_that_holds_itself_fails_typed(ex, make_ctx):
    with pytest.raises(ExecutorError, match="nested too deeply to send"):
        ex.run(spec(f"{MOD}:holds_itself"), {}, make_ctx())
