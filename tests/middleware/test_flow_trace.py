"""The flows hand the request middleware trace to ``on_trace``, also when a later step refuses the call."""

from __future__ import annotations

from typing import Any

import pytest

from middleware import LLMCallFlow, MiddlewareRegistry, ToolCallFlow


def jail(**kw: Any) -> dict[str, Any]:
    return {"args": {**kw["args"], "path": "/jail/x"}, "source": "jailer", "reason": "pinned"}


def test_tool_flow_reports_the_tool_request_trace_before_policy_refuses(registry: MiddlewareRegistry) -> None:
    registry.register_middleware("tool_request", jail)
    seen: list[list[dict[str, Any]]] = []

    def refuse(tool: str, args: dict[str, Any], ctx: dict[str, Any]) -> None:
        assert seen, "the trace is reported before the policy step"
        raise PermissionError(args["path"])

    with pytest.raises(PermissionError, match="/jail/x"):
        ToolCallFlow(registry).run(
            "read", {"path": "/etc"}, execute=lambda a: a, policy=refuse, on_trace=seen.append
        )
    assert len(seen) == 1
    assert [(t["source"], t["reason"]) for t in seen[0]] == [("jailer", "pinned")]


def test_tool_flow_reports_an_empty_trace_when_no_middleware_changed_the_args(
    registry: MiddlewareRegistry,
) -> None:
    registry.register_middleware("tool_request", lambda **kw: None)
    seen: list[list[dict[str, Any]]] = []
    assert ToolCallFlow(registry).run("t", {"a": 1}, execute=lambda a: a, on_trace=seen.append) == {"a": 1}
    assert seen == [[]]


def test_llm_flow_reports_each_attempts_llm_request_trace(registry: MiddlewareRegistry) -> None:
    registry.register_middleware(
        "llm_request", lambda **kw: {"request": {**kw["request"], "tag": 1}, "source": "tagger"}
    )
    seen: list[list[dict[str, Any]]] = []
    flow = LLMCallFlow(registry)
    for _ in range(2):
        flow.run({"model": "m"}, call_provider=lambda r: r, on_trace=seen.append)
    assert [[t["source"] for t in trace] for trace in seen] == [["tagger"], ["tagger"]]
