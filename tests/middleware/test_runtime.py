"""The runtime snapshot: the empty fast path, chains folded once per registration change."""

from __future__ import annotations

from typing import Any

from middleware import LLMCallFlow, MiddlewareRegistry, ToolCallFlow
from middleware.runtime import MiddlewareRuntime


def test_empty_runtime_is_a_fast_path_with_no_copies(registry: MiddlewareRegistry) -> None:
    rt = registry.runtime()
    assert rt.empty
    args = {"command": "ls"}
    effective, trace = rt.apply_tool_request({}, "terminal", args)
    assert effective is args and trace == []
    request = {"model": "m"}
    assert rt.apply_llm_request({}, request)[0] is request
    assert rt.run_tool_execution({}, "terminal", args, lambda a: a) is args
    seen: list[Any] = []
    ToolCallFlow(registry).run("terminal", args, execute=seen.append)
    LLMCallFlow(registry).run(request, call_provider=seen.append)
    assert seen[0] is args and seen[1] is request  # the base got the caller's own objects


def test_hooks_alone_make_the_runtime_non_empty(registry: MiddlewareRegistry) -> None:
    registry.register_hook("post_tool_call", lambda **kw: None)
    assert not registry.runtime().empty


def test_the_snapshot_and_its_chains_are_reused_until_registration_changes(
    registry: MiddlewareRegistry,
) -> None:
    registry.register_middleware("tool_execution", lambda **kw: kw["next_call"](kw["args"]))
    first = registry.runtime()
    chain = first._chains["tool_execution"]
    for _ in range(3):
        assert registry.runtime() is first
        ToolCallFlow(registry).run("t", {}, execute=lambda a: a)
    assert first._chains["tool_execution"] is chain  # folded once, not per call
    registry.register_middleware("tool_execution", lambda **kw: kw["next_call"](kw["args"]))
    second = registry.runtime()
    assert second is not first and second._chains["tool_execution"] is not chain


def test_a_call_in_flight_keeps_the_snapshot_it_started_with(registry: MiddlewareRegistry) -> None:
    outer: list[str] = []
    registry.register_middleware(
        "tool_execution", lambda **kw: outer.append("v1") or kw["next_call"](kw["args"])
    )

    def tool(args: Any) -> str:
        # registering mid-call must not change the chain this call is already running through
        registry.register_middleware(
            "tool_execution", lambda **kw: outer.append("v2") or kw["next_call"](kw["args"])
        )
        return "done"

    assert ToolCallFlow(registry).run("t", {}, execute=tool) == "done"
    assert outer == ["v1"]


def test_runtime_can_be_used_directly_as_a_flow_source(registry: MiddlewareRegistry) -> None:
    registry.register_middleware("tool_request", lambda **kw: {"args": {"x": 2}})
    rt = registry.runtime()
    assert isinstance(rt, MiddlewareRuntime)
    assert rt.run_tool_call("t", {"x": 1}, execute=lambda a: a) == {"x": 2}
    assert ToolCallFlow(rt).run("t", {"x": 1}, execute=lambda a: a) == {"x": 2}


def test_uncopyable_request_members_are_shared_not_fatal(registry: MiddlewareRegistry) -> None:
    import threading

    lock = threading.Lock()  # deepcopy fails on locks; the request must still go through
    registry.register_middleware("llm_request", lambda **kw: {"request": {**kw["request"], "tagged": True}})
    out, trace = registry.runtime().apply_llm_request({}, {"client": lock, "model": "m"})
    assert out["client"] is lock and out["tagged"] is True and len(trace) == 1


def test_without_leaves_out_the_named_plugins_callbacks_only(registry: MiddlewareRegistry) -> None:
    registry.register_middleware("tool_request", lambda **kw: {"args": {**kw["args"], "a": 1}}, plugin="a")
    registry.register_middleware("tool_request", lambda **kw: {"args": {**kw["args"], "b": 1}}, plugin="b")
    seen: list[str] = []
    registry.register_hook("post_tool_call", lambda **kw: seen.append("a"), plugin="a")
    flow = ToolCallFlow(registry)
    assert flow.run("t", {}, execute=lambda a: a) == {"a": 1, "b": 1} and seen == ["a"]
    assert flow.run("t", {}, execute=lambda a: a, skip_plugins=("a",)) == {"b": 1} and seen == ["a"]
    rt = registry.runtime()
    assert rt.without(("a",)) is rt.without(["a"])  # built once per set
    assert rt.without(()) is rt and rt.without(("a", "b")).empty


def test_a_request_outcome_says_whether_middleware_changed_it_and_lists_registrations_in_order(
    registry: MiddlewareRegistry,
) -> None:
    assert not registry.runtime().tool_request({}, "t", {"a": 1}).changed
    first, second = (lambda **kw: None), (lambda **kw: {"args": {"a": 2}})
    registry.register_middleware("tool_request", first)
    registry.register_middleware("tool_request", second)
    rt = registry.runtime()
    assert [r.callback for r in rt.middleware("tool_request")] == [first, second]
    outcome = rt.tool_request({}, "t", {"a": 1})
    assert outcome.changed and outcome.payload == {"a": 2} and outcome.original == {"a": 1}
