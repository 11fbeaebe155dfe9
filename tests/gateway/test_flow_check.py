"""A flow document is checked whole before any call: every name an expression reads, and every step it
names, exist (``flow check`` and ``flow run`` both load it this way)."""

from __future__ import annotations

from typing import Any

import pytest

from broker.errors import FlowError
from hermes_gateway.flow import Expression, Flow


def flow(*steps: dict[str, Any], result: Any = None) -> Flow:
    return Flow.from_dict({"name": "x", "steps": list(steps), **({"result": result} if result else {})})


def test_a_flow_reading_only_its_args_its_steps_and_its_items_passes() -> None:
    flow(
        {"id": "a", "tool": "hello", "args": {"name": "{{ args.who }}"}},
        {"id": "b", "tool": "hello", "args": {"name": "{{ steps.a.result }}"}, "when": "steps.a.state == 'done'"},
        {"id": "c", "for_each": "steps.b.result", "as": "n", "tool": "hello", "args": {"name": "{{ n }} #{{ index }}"}},
        {"id": "d", "parallel": [{"id": "e", "tool": "hello", "args": {"x": "{{ steps['c'].result }}"}}]},
        result={"last": "{{ steps.e.result }}"},
    )


@pytest.mark.parametrize(
    ("steps", "result", "message"),
    [
        ([{"id": "a", "tool": "t"}, {"id": "b", "tool": "t", "args": {"n": "{{ step.a.result }}"}}], None,
         "step b: expression 'step.a.result': unknown name 'step' (known here: args, steps)"),
        ([{"id": "s", "tool": "t", "args": {"name": "{{ steps.zz.result }}"}}], None,
         "step s: expression 'steps.zz.result': no step 'zz' in this flow (its steps: s)"),
        ([{"id": "s", "tool": "t", "when": "args.ok and arg.x"}], None, "unknown name 'arg'"),
        ([{"id": "s", "tool": "t", "args": {"n": "{{ item }}"}}], None, "unknown name 'item'"),  # (not a for_each)
        ([{"id": "s", "tool": "t"}], {"r": "{{ steps.t.result }}"}, "no step 't' in this flow"),
    ],
)
def test_a_name_or_step_that_does_not_exist_is_refused_when_the_flow_loads(
    steps: list[dict[str, Any]], result: Any, message: str
) -> None:
    with pytest.raises(FlowError) as refused:
        flow(*steps, result=result)
    assert message in str(refused.value)


RAN_LATER = (
    "has not run yet here (it comes later, "
    "runs in parallel with this one, or is this step or a group around it)"
)


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([{"id": "a", "tool": "t", "args": {"n": "{{ steps.b.result }}"}}, {"id": "b", "tool": "t"}],
         f"step a: expression 'steps.b.result': step 'b' {RAN_LATER}"),
        ([{"id": "a", "tool": "t", "when": "steps.a.state == 'done'"}], f"step 'a' {RAN_LATER}"),
        ([{"id": "p", "parallel": [{"id": "x", "tool": "t"}, {"id": "y", "tool": "t", "args": "{{ steps.x }}"}]}],
         f"step y: expression 'steps.x': step 'x' {RAN_LATER}"),
        ([{"id": "p", "parallel": [{"id": "x", "tool": "t"},
                                   {"id": "g", "steps": [{"id": "y", "tool": "t", "when": "steps.x.ok"}]}]}],
         f"step y: expression 'steps.x.ok': step 'x' {RAN_LATER}"),
        ([{"id": "g", "steps": [{"id": "y", "tool": "t", "args": {"n": "{{ steps.g.result }}"}}]}],
         f"step y: expression 'steps.g.result': step 'g' {RAN_LATER}"),
        ([{"id": "g", "when": "steps.y.ok", "steps": [{"id": "y", "tool": "t"}]}],
         f"step g: expression 'steps.y.ok': step 'y' {RAN_LATER}"),
        ([{"id": "e", "for_each": "steps.e.result", "tool": "t"}],
         f"step e: expression 'steps.e.result': step 'e' {RAN_LATER}"),
    ],
)
def test_a_step_reading_a_step_that_has_not_run_before_it_is_refused_when_the_flow_loads(
    steps: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(FlowError) as refused:
        flow(*steps)
    assert message in str(refused.value)


def test_steps_may_read_what_ended_before_them_in_groups_and_after_a_parallel_step() -> None:
    flow(
        {"id": "a", "tool": "t"},
        {"id": "p", "when": "steps.a.ok", "parallel": [
            {"id": "x", "tool": "t", "args": "{{ steps.a.result }}"},
            {"id": "g", "steps": [{"id": "y1", "tool": "t"},
                                  {"id": "y2", "tool": "t", "args": "{{ steps.y1.result }}"}]},
        ]},
        {"id": "z", "tool": "t", "args": {"x": "{{ steps.x.result }}", "y": "{{ steps.y2.result }}",
                                          "p": "{{ steps.p }}"}},
        result="{{ steps.z.result }}",
    )  # fmt: skip


def test_deep_long_or_overflowing_expressions_are_flow_errors_not_tracebacks() -> None:
    from hermes_gateway.flows.expr import MAX_CHARS, Expression

    for text in ("(" * 130 + "1" + ")" * 130, "[" * 120 + "1" + "]" * 120):
        with pytest.raises(FlowError, match="nested too deeply"):
            Expression(text)
    with pytest.raises(FlowError, match=f"more than {MAX_CHARS}"):
        Expression("+".join(["1"] * 1000))
    assert Expression("+".join(["1"] * 450)).evaluate({}) == 450
    with pytest.raises(FlowError, match="cannot convert float infinity to integer"):
        Expression("int(args.v)").evaluate({"args": {"v": 1e999}})


@pytest.mark.parametrize("timeout", [0, -5, True, "10"])
def test_a_step_timeout_must_be_seconds_above_zero_at_check_time(timeout: Any) -> None:
    with pytest.raises(FlowError, match="timeout: expected a number of seconds above 0"):
        Flow.from_dict({"name": "t", "steps": [{"id": "a", "tool": "echo", "args": {}, "timeout": timeout}]})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("len(steps.a.result.items) > 0", "len() of a NoneType"),
        ("steps.a.result.count + 1", "expected a number, got None"),
        ("-steps.a.result.count", "expected a number, got None"),
    ],
)
def test_an_expression_failing_on_a_missing_field_names_itself(text: str, message: str) -> None:
    with pytest.raises(FlowError) as failed:
        Expression(text).evaluate({"steps": {"a": {"result": {}}}})
    assert str(failed.value) == f"expression {text!r}: {message}" and failed.value.details == {"expression": text}
