"""ToolCallFlow / LLMCallFlow details: blocks, statuses, durations and observer payload fields."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest

from middleware import LLMCallFlow, MiddlewareRegistry, ToolCallFlow


class Cancelled(Exception):
    type = "cancelled"


class Timeout(Exception):
    type = "tool_timeout"


def record(registry: MiddlewareRegistry, hook: str) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    registry.register_hook(hook, lambda **kw: seen.append(kw))
    return seen


def test_pre_tool_call_block_directive_blocks_before_policy_and_execution(
    registry: MiddlewareRegistry,
) -> None:
    registry.register_hook("pre_tool_call", lambda **kw: {"action": "block", "message": "no terminal today"})
    post = record(registry, "post_tool_call")
    ran: list[str] = []
    flow = ToolCallFlow(registry, policy=lambda *a: ran.append("policy"))
    result = flow.run("terminal", {"command": "ls"}, execute=lambda a: ran.append("execute"))
    assert result == {"error": "no terminal today"}
    assert ran == []
    assert post[0]["status"] == "blocked" and post[0]["error_message"] == "no terminal today"
    assert post[0]["error_type"] == "plugin_block"


def test_block_without_message_is_ignored_as_in_hermes(registry: MiddlewareRegistry) -> None:
    registry.register_hook("pre_tool_call", lambda **kw: {"action": "block"})
    assert ToolCallFlow(registry).run("t", {}, execute=lambda a: "ran") == "ran"


def test_on_blocked_lets_the_worker_raise_its_own_error(registry: MiddlewareRegistry) -> None:
    registry.register_hook("pre_tool_call", lambda **kw: {"action": "block", "message": "nope"})

    def on_blocked(tool: str, message: str, ctx: dict[str, Any]) -> Any:
        raise PermissionError(f"{tool}: {message} ({ctx['session_id']})")

    flow = ToolCallFlow(registry, on_blocked=on_blocked)
    with pytest.raises(PermissionError, match="t: nope \\(s9\\)"):
        flow.run("t", {}, execute=lambda a: None, context={"session_id": "s9"})


def test_approve_directive_asks_the_approval_gate_and_fails_closed_without_one(
    registry: MiddlewareRegistry,
) -> None:
    registry.register_hook("pre_tool_call", lambda **kw: {"action": "approve", "message": "sure?"})
    blocked = {"error": "BLOCKED: plugin approval required for t: sure?"}
    assert ToolCallFlow(registry).run("t", {}, execute=lambda a: "ran") == blocked
    approved = ToolCallFlow(registry, approve=lambda tool, msg, ctx: msg == "sure?")
    assert approved.run("t", {}, execute=lambda a: "ran") == "ran"
    denied = ToolCallFlow(registry, approve=lambda tool, msg, ctx: False)
    assert denied.run("t", {}, execute=lambda a: "ran") == blocked


@pytest.mark.parametrize(
    ("error", "status", "error_type"),
    [
        (Timeout("too slow"), "error", "tool_timeout"),
        (ValueError("bad"), "error", "ValueError"),
        (Cancelled("stop"), "cancelled", "cancelled"),
        (concurrent.futures.CancelledError(), "cancelled", "CancelledError"),
    ],
)
def test_post_tool_call_reports_failures_with_status_and_type(
    registry: MiddlewareRegistry, error: Exception, status: str, error_type: str
) -> None:
    post = record(registry, "post_tool_call")
    transformed = record(registry, "transform_tool_result")

    def execute(args: Any) -> Any:
        raise error

    with pytest.raises(type(error)):
        ToolCallFlow(registry).run("t", {"a": 1}, execute=execute)
    assert post[0]["status"] == status and post[0]["error_type"] == error_type
    assert post[0]["result"] is None and post[0]["args"] == {"a": 1}
    assert transformed == []  # only a successful result is transformed


def test_policy_refusal_is_reported_blocked_and_raised(registry: MiddlewareRegistry) -> None:
    post = record(registry, "post_tool_call")

    def policy(tool: str, args: dict[str, Any], ctx: dict[str, Any]) -> None:
        raise PermissionError("missing permission read_only")

    ran: list[Any] = []
    with pytest.raises(PermissionError):
        ToolCallFlow(registry, policy=policy).run("t", {}, execute=ran.append)
    assert ran == [] and post[0]["status"] == "blocked"


def test_unavailable_tool_is_reported_as_error_before_pre_tool_call(registry: MiddlewareRegistry) -> None:
    pre = record(registry, "pre_tool_call")
    post = record(registry, "post_tool_call")

    def unavailable(tool: str, args: dict[str, Any], ctx: dict[str, Any]) -> None:
        raise LookupError("no such tool")

    with pytest.raises(LookupError):
        ToolCallFlow(registry, check_available=unavailable).run("t", {}, execute=lambda a: None)
    assert pre == [] and post[0]["status"] == "error"


def test_post_tool_call_ok_payload(registry: MiddlewareRegistry) -> None:
    post = record(registry, "post_tool_call")
    ToolCallFlow(registry).run("t", {"a": 1}, execute=lambda a: "out", context={"tool_call_id": "c"})
    [payload] = post
    assert payload["status"] == "ok" and payload["result"] == "out" and payload["tool_call_id"] == "c"
    assert isinstance(payload["duration_ms"], int) and payload["duration_ms"] >= 0
    assert payload["telemetry_schema_version"] == "hermes.observer.v1"
    assert payload["error_type"] is None and payload["middleware_trace"] == []


def test_per_call_checks_override_the_flows(registry: MiddlewareRegistry) -> None:
    registry.register_hook("post_tool_call", lambda **kw: None)
    calls: list[str] = []
    flow = ToolCallFlow(registry, policy=lambda *a: calls.append("flow"))
    flow.run("t", {}, execute=lambda a: None, policy=lambda *a: calls.append("call"))
    assert calls == ["call"]


def test_api_request_error_payload_carries_the_error(registry: MiddlewareRegistry) -> None:
    errors = record(registry, "api_request_error")

    class RateLimited(Exception):
        type = "rate_limited"
        status_code = 429
        retryable = True

    def provider(req: Any) -> Any:
        raise RateLimited("slow down")

    with pytest.raises(RateLimited):
        LLMCallFlow(registry).run({"model": "m"}, call_provider=provider, context={"model": "m"})
    [payload] = errors
    assert payload["error"] == {"type": "rate_limited", "message": "slow down"}
    assert payload["status_code"] == 429 and payload["retryable"] is True
    assert payload["request"] == {"method": "POST", "body": {"model": "m"}} and payload["model"] == "m"
    assert payload["reason"] == "rate_limited"


def test_post_api_request_payload_describes_the_response(registry: MiddlewareRegistry) -> None:
    post = record(registry, "post_api_request")
    pre = record(registry, "pre_api_request")
    flow = LLMCallFlow(registry, describe_response=lambda r: {"usage": r["usage"]})
    request = {"model": "m", "messages": [{"role": "user"}] * 3, "tools": [{}, {}]}
    flow.run(request, call_provider=lambda req: {"model": "m-2024", "usage": {"input_tokens": 3}})
    assert post[0]["usage"] == {"input_tokens": 3} and post[0]["response_model"] == "m-2024"
    assert post[0]["api_duration"] >= 0 and post[0]["ended_at"] >= post[0]["started_at"]
    assert pre[0]["message_count"] == 3 and pre[0]["tool_count"] == 2


def test_transform_tool_result_takes_the_first_string_dict_or_list_and_ignores_other_returns(
    registry: MiddlewareRegistry,
) -> None:
    registry.register_hook("transform_tool_result", lambda **kw: False)  # ignored, as Hermes ignores it
    registry.register_hook("transform_tool_result", lambda **kw: 0)
    registry.register_hook("transform_tool_result", lambda **kw: "REPLACED")
    registry.register_hook("transform_tool_result", lambda **kw: "too late")
    assert ToolCallFlow(registry).run("t", {}, execute=lambda a: {"rows": 1}) == "REPLACED"


def test_transform_tool_result_with_only_non_replacements_keeps_the_result(registry: MiddlewareRegistry) -> None:
    registry.register_hook("transform_tool_result", lambda **kw: True)
    assert ToolCallFlow(registry).run("t", {}, execute=lambda a: {"rows": 1}) == {"rows": 1}


@pytest.mark.parametrize(
    ("result", "status"),
    [
        ({"error": "boom"}, ("error", "tool_error", "boom")),
        ('{"error": "boom"}', ("error", "tool_error", "boom")),
        ({"error": ""}, ("ok", None, None)),
        ("plain text", ("ok", None, None)),
        ({"rows": 1}, ("ok", None, None)),
    ],
)
def test_a_returned_error_result_is_status_error_for_post_tool_call_and_transform(
    registry: MiddlewareRegistry, result: Any, status: tuple[Any, ...]
) -> None:
    post = record(registry, "post_tool_call")
    transform = record(registry, "transform_tool_result")
    ToolCallFlow(registry).run("t", {}, execute=lambda a: result)
    for payload in (post[0], transform[0]):
        assert (payload["status"], payload["error_type"], payload["error_message"]) == status
    assert "middleware_trace" in post[0] and "middleware_trace" not in transform[0]  # as Hermes sends them


def test_llm_hooks_get_hermes_shapes_and_fields(registry: MiddlewareRegistry) -> None:
    pre = record(registry, "pre_api_request")
    post = record(registry, "post_api_request")
    seen: list[dict[str, Any]] = []
    registry.register_middleware("llm_request", lambda **kw: seen.append(kw))
    request = {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "timeout": 30,
    }
    response = {
        "model": "m-1",
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {"role": "assistant", "content": "ok", "tool_calls": [{"id": "c1"}]},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    context = {"platform": "cli", "base_url": "http://x/v1", "api_call_count": 2, "model": "m"}
    LLMCallFlow(registry).run(request, call_provider=lambda req: response, context=context)
    for payload in (seen[0], pre[0], post[0]):
        assert (payload["platform"], payload["base_url"], payload["api_call_count"]) == ("cli", "http://x/v1", 2)
    assert pre[0]["request"] == {"method": "POST", "body": {k: v for k, v in request.items() if k != "timeout"}}
    assert pre[0]["user_message"] == "hi" and pre[0]["message_count"] == 2 and pre[0]["max_tokens"] == 50
    assert pre[0]["request_messages"] == request["messages"] and pre[0]["request_char_count"] > 0
    assert post[0]["response"] == {
        "model": "m-1",
        "finish_reason": "tool_calls",
        "assistant_message": {"role": "assistant", "content": "ok", "tool_calls": [{"id": "c1"}]},
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    assert post[0]["assistant_content_chars"] == 2 and post[0]["assistant_tool_call_count"] == 1
    assert post[0]["response_model"] == "m-1" and post[0]["finish_reason"] == "tool_calls"
