"""One test per sentence of the contract (seeds/hermes-middleware.zh.md), named after its clause."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from middleware import (
    KINDS,
    MIDDLEWARE_SCHEMA_VERSION,
    TELEMETRY_SCHEMA_VERSION,
    LLMCallFlow,
    MiddlewareRegistry,
    PluginManager,
    ToolCallFlow,
    enable_plugin,
)
from tests.middleware.helpers import install_example, warnings_of, write_plugin

TOOL_CTX = {
    "session_id": "s1",
    "task_id": "t1",
    "turn_id": "u1",
    "api_request_id": "r1",
    "tool_call_id": "c1",
}
LLM_CTX = {
    "session_id": "s1",
    "task_id": "t1",
    "turn_id": "u1",
    "api_request_id": "r1",
    "provider": "openai",
    "model": "gpt-x",
    "api_mode": "chat_completions",
}


def recorder(seen: list[dict[str, Any]], returns: Any = None):
    def mw(**kwargs: Any) -> Any:
        seen.append(kwargs)
        if "next_call" in kwargs:
            key = "request" if "request" in kwargs else "args"
            return kwargs["next_call"](kwargs[key])
        return returns

    return mw


def run_tool(registry: MiddlewareRegistry, args: dict[str, Any] | None = None, **flow: Any) -> Any:
    execute = flow.pop("execute", lambda a: {"ok": True, "args": a})
    return ToolCallFlow(registry, **flow).run(
        "terminal", args or {"command": "ls"}, execute=execute, context=TOOL_CTX
    )


def run_llm(registry: MiddlewareRegistry, request: dict[str, Any] | None = None, provider: Any = None) -> Any:
    provider = provider or (lambda req: {"model": req["model"], "choices": [{"text": "ok"}]})
    request = request or {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}
    return LLMCallFlow(registry).run(request, call_provider=provider, context=LLM_CTX)


# -- 契约: register(ctx) --------------------------------------------------------------------------


def test_clause_plugin_registers_the_four_kinds_from_register_ctx(registry: MiddlewareRegistry) -> None:
    seen: list[dict[str, Any]] = []

    def register(ctx: Any) -> None:
        for kind in ("llm_request", "llm_execution", "tool_request", "tool_execution"):
            ctx.register_middleware(kind, recorder(seen))

    ctx = registry.context("p")
    register(ctx)
    assert ctx.middleware_registered == list(KINDS)
    assert all(registry.runtime().has_middleware(k) for k in KINDS)
    run_tool(registry)
    run_llm(registry)
    assert len(seen) == 4


def test_clause_unknown_kind_is_a_warning_naming_the_valid_kinds(
    registry: MiddlewareRegistry, logs: list
) -> None:
    registry.context("p").register_middleware("tool_reqest", lambda **kw: None)
    [warning] = warnings_of(logs)
    for kind in KINDS:
        assert kind in warning["event"]
    assert "tool_reqest" in warning["event"]
    assert registry.runtime().empty


# -- 每个中间件回调收到 ----------------------------------------------------------------------------


def test_clause_every_callback_receives_both_schema_versions(registry: MiddlewareRegistry) -> None:
    seen: list[dict[str, Any]] = []
    for kind in KINDS:
        registry.register_middleware(kind, recorder(seen))
    run_tool(registry)
    run_llm(registry)
    assert len(seen) == 4
    for kwargs in seen:
        assert kwargs["telemetry_schema_version"] == TELEMETRY_SCHEMA_VERSION == "hermes.observer.v1"
        assert kwargs["middleware_schema_version"] == MIDDLEWARE_SCHEMA_VERSION == "hermes.middleware.v1"


def test_clause_every_callback_receives_the_runtime_context(registry: MiddlewareRegistry) -> None:
    tool_seen: list[dict[str, Any]] = []
    llm_seen: list[dict[str, Any]] = []
    registry.register_middleware("tool_request", recorder(tool_seen))
    registry.register_middleware("tool_execution", recorder(tool_seen))
    registry.register_middleware("llm_request", recorder(llm_seen))
    registry.register_middleware("llm_execution", recorder(llm_seen))
    run_tool(registry)
    run_llm(registry)
    for kwargs in tool_seen:
        assert {k: kwargs[k] for k in TOOL_CTX} == TOOL_CTX
        assert kwargs["tool_name"] == "terminal"
    for kwargs in llm_seen:
        assert {k: kwargs[k] for k in LLM_CTX} == LLM_CTX


def test_clause_context_fields_that_apply_are_present_even_when_unknown(registry: MiddlewareRegistry) -> None:
    seen: list[dict[str, Any]] = []
    registry.register_middleware("tool_request", recorder(seen))
    ToolCallFlow(registry).run("terminal", {}, execute=lambda a: None, context={"session_id": "s"})
    assert seen[0]["session_id"] == "s"
    assert seen[0]["tool_call_id"] == seen[0]["turn_id"] == ""


def test_clause_every_callback_gets_the_whole_runtime_context_list(registry: MiddlewareRegistry) -> None:
    """运行时上下文，如 session_id、task_id、turn_id、api_request_id、provider、model、api_mode、tool_name: a tool
    callback gets its agent's provider, model and api_mode when the call carries them ("" when not), and
    an LLM callback a tool_name ("")."""
    listed = ("session_id", "task_id", "turn_id", "api_request_id", "provider", "model", "api_mode", "tool_name")
    seen: list[dict[str, Any]] = []
    for kind in KINDS:
        registry.register_middleware(kind, recorder(seen))
    run_tool(registry)
    run_llm(registry)
    assert len(seen) == 4 and all(set(listed) <= set(kw) for kw in seen)
    assert [(kw["model"], kw["tool_name"]) for kw in seen] == [("", "terminal")] * 2 + [("gpt-x", "")] * 2
    seen.clear()
    agent = {**TOOL_CTX, "provider": "openai", "model": "gpt-x", "api_mode": "chat_completions"}
    ToolCallFlow(registry).run("terminal", {"command": "ls"}, execute=lambda a: a, context=agent)
    assert [(kw["provider"], kw["model"], kw["api_mode"]) for kw in seen] == [("openai", "gpt-x", "chat_completions")] * 2


# -- 支持的中间件种类 (the table) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("llm_request", {"request", "original_request"}),
        ("tool_request", {"tool_name", "args", "original_args"}),
        ("llm_execution", {"request", "original_request", "next_call"}),
        ("tool_execution", {"tool_name", "args", "original_args", "next_call"}),
    ],
)
def test_clause_kind_payload_has_the_table_fields(
    registry: MiddlewareRegistry, kind: str, fields: set
) -> None:
    seen: list[dict[str, Any]] = []
    registry.register_middleware(kind, recorder(seen))
    run_tool(registry) if kind.startswith("tool") else run_llm(registry)
    assert fields <= set(seen[0])


def test_clause_llm_request_replaces_effective_provider_kwargs(registry: MiddlewareRegistry) -> None:
    registry.register_middleware(
        "llm_request", lambda **kw: {"request": {**kw["request"], "model": "fallback"}}
    )
    sent: list[dict[str, Any]] = []
    run_llm(registry, provider=lambda req: sent.append(req) or {"model": req["model"]})
    assert sent[0]["model"] == "fallback"


def test_clause_tool_request_replaces_args_before_hooks_guardrails_and_execution(
    registry: MiddlewareRegistry,
) -> None:
    registry.register_middleware("tool_request", lambda **kw: {"args": {**kw["args"], "command": "pwd"}})
    observed: dict[str, Any] = {}
    registry.register_hook("pre_tool_call", lambda **kw: observed.setdefault("hook", kw["args"]["command"]))
    result = run_tool(
        registry,
        policy=lambda name, args, ctx: observed.setdefault("policy", args["command"]),
        execute=lambda a: observed.setdefault("executor", a["command"]),
    )
    assert observed == {"hook": "pwd", "policy": "pwd", "executor": "pwd"}
    assert result == "pwd"


def test_clause_llm_execution_wraps_or_replaces_the_provider_call(registry: MiddlewareRegistry) -> None:
    calls: list[Any] = []
    registry.register_middleware(
        "llm_execution", lambda **kw: {"cached": True, "model": kw["request"]["model"]}
    )
    response = run_llm(registry, provider=lambda req: calls.append(req))
    assert response == {"cached": True, "model": "gpt-x"}
    assert calls == []  # replaced: the provider never ran


def test_clause_tool_execution_wraps_or_replaces_the_tool_call(registry: MiddlewareRegistry) -> None:
    registry.register_middleware("tool_execution", lambda **kw: {"wrapped": kw["next_call"](kw["args"])})
    assert run_tool(registry, execute=lambda a: "raw") == {"wrapped": "raw"}


# -- 请求中间件可返回可选的追踪字段 ------------------------------------------------------------------


def test_clause_trace_fields_become_middleware_trace_in_later_observer_payloads(
    registry: MiddlewareRegistry,
) -> None:
    registry.register_middleware(
        "tool_request",
        lambda **kw: {"args": dict(kw["args"]), "source": "my-plugin", "reason": "selected fallback"},
        plugin="p",
    )
    registry.register_middleware(
        "llm_request", lambda **kw: {"request": dict(kw["request"]), "reason": "r"}, plugin="q"
    )
    traces: dict[str, Any] = {}
    for hook in ("pre_tool_call", "post_tool_call", "pre_api_request", "post_api_request"):
        registry.register_hook(hook, lambda _h=hook, **kw: traces.setdefault(_h, kw["middleware_trace"]))
    exec_payloads: list[Any] = []
    registry.register_middleware(
        "tool_execution",
        lambda **kw: exec_payloads.append(kw) or kw["next_call"](kw["args"]),
    )
    run_tool(registry)
    run_llm(registry)
    # Exactly what the plugin returned, as Hermes stores it; tool_execution gets no trace (Hermes sends none).
    tool_trace = [{"source": "my-plugin", "reason": "selected fallback"}]
    assert traces["pre_tool_call"] == traces["post_tool_call"] == tool_trace
    assert "middleware_trace" not in exec_payloads[0]
    assert traces["pre_api_request"] == traces["post_api_request"] == [{"reason": "r"}]


def test_clause_a_trace_entry_with_none_of_source_reason_name_is_source_plugin(
    registry: MiddlewareRegistry,
) -> None:
    registry.register_middleware("tool_request", lambda **kw: {"args": {"x": 2}, "source": ""}, plugin="p")
    seen: list[Any] = []
    registry.register_hook("pre_tool_call", lambda **kw: seen.append(kw["middleware_trace"]))
    run_tool(registry)
    assert seen == [[{"source": "plugin"}]]


# -- 执行中间件收到一个 next_call 回调 --------------------------------------------------------------


def test_clause_next_call_continues_the_chain(registry: MiddlewareRegistry) -> None:
    def on_tool_execution(**kwargs: Any) -> Any:
        result = kwargs["next_call"](kwargs["args"])
        return result

    registry.register_middleware("tool_execution", on_tool_execution)
    assert run_tool(registry, execute=lambda a: ("ran", a["command"])) == ("ran", "ls")


def test_clause_several_execution_middleware_nest_in_registration_order(registry: MiddlewareRegistry) -> None:
    order: list[str] = []

    def layer(name: str):
        def mw(**kw: Any) -> Any:
            order.append(f"{name}>")
            out = kw["next_call"](kw["args"])
            order.append(f"<{name}")
            return out

        return mw

    for name in ("a", "b", "c"):
        registry.register_middleware("tool_execution", layer(name))
    run_tool(registry, execute=lambda a: order.append("tool"))
    assert order == ["a>", "b>", "c>", "tool", "<c", "<b", "<a"]


def test_clause_failing_middleware_is_fail_open_with_a_warning(
    registry: MiddlewareRegistry, logs: list
) -> None:
    def broken(**kw: Any) -> Any:
        raise ValueError("boom")

    registry.register_middleware("tool_request", broken)
    registry.register_middleware("tool_request", lambda **kw: {"args": {**kw["args"], "x": 1}})
    registry.register_middleware("tool_execution", broken)
    result = run_tool(registry, execute=lambda a: a)
    assert result == {"command": "ls", "x": 1}  # next middleware and the base path still ran
    assert len(warnings_of(logs)) == 2


def test_clause_identical_failures_warn_once_listing_the_given_fields(
    registry: MiddlewareRegistry, logs: list
) -> None:
    def misdeclared(request: dict, conversation: list) -> None:  # names a field Hermes does not send
        return None

    registry.register_middleware("llm_request", misdeclared)
    for _ in range(5):
        run_llm(registry)
    [warning] = warnings_of(logs)
    for field in ("request", "original_request", "model", "telemetry_schema_version"):
        assert field in warning["event"]
        assert field in warning["fields_given"]
    repeats = [e for e in logs if e["log_level"] == "debug" and e.get("repeated")]
    assert len(repeats) == 4


def test_clause_plugin_reload_resets_the_warn_once_report(home: Path, logs: list) -> None:
    write_plugin(
        home, "bad", "def register(ctx):\n    ctx.register_middleware('tool_request', lambda x: None)\n"
    )
    enable_plugin(home, "bad")
    manager = PluginManager(home)
    manager.load()
    flow = ToolCallFlow(manager)
    for _ in range(3):
        flow.run("t", {}, execute=lambda a: None)
    assert len([w for w in warnings_of(logs) if "tool_request callback" in w["event"]]) == 1
    manager.reload()
    for _ in range(3):
        flow.run("t", {}, execute=lambda a: None)
    assert len([w for w in warnings_of(logs) if "tool_request callback" in w["event"]]) == 2


# -- 执行顺序: LLM 调用 --------------------------------------------------------------------------


def test_clause_llm_call_order(registry: MiddlewareRegistry) -> None:
    order: list[str] = []
    registry.register_middleware("llm_request", lambda **kw: order.append("llm_request"))
    registry.register_hook("pre_api_request", lambda **kw: order.append("pre_api_request"))
    registry.register_middleware(
        "llm_execution", lambda **kw: order.append("llm_execution") or kw["next_call"](None)
    )
    registry.register_hook("post_api_request", lambda **kw: order.append("post_api_request"))
    registry.register_hook("api_request_error", lambda **kw: order.append("api_request_error"))
    run_llm(registry, provider=lambda req: order.append("provider") or {})
    assert order == ["llm_request", "pre_api_request", "llm_execution", "provider", "post_api_request"]
    order.clear()

    def failing(req: Any) -> Any:
        order.append("provider")
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        run_llm(registry, provider=failing)
    assert order == ["llm_request", "pre_api_request", "llm_execution", "provider", "api_request_error"]


def test_clause_a_model_the_request_middleware_chose_is_the_model_later_callbacks_are_told(
    registry: MiddlewareRegistry,
) -> None:
    """以生效请求发出 pre_api_request: after llm_request picks a fallback model, pre_api_request,
    llm_execution and post_api_request name the model that runs, not the one first asked for."""
    told: list[tuple[str, str]] = []
    registry.register_middleware(
        "llm_request", lambda **kw: {"request": {**kw["request"], "model": "fallback"}, "reason": "selected fallback model"}
    )
    registry.register_hook("pre_api_request", lambda **kw: told.append(("pre_api_request", kw["model"])))
    registry.register_middleware(
        "llm_execution", lambda **kw: told.append(("llm_execution", kw["model"])) or kw["next_call"](kw["request"])
    )
    registry.register_hook("post_api_request", lambda **kw: told.append(("post_api_request", kw["model"])))
    run_llm(registry)
    assert told == [("pre_api_request", "fallback"), ("llm_execution", "fallback"), ("post_api_request", "fallback")]


def test_clause_original_args_stay_as_they_were_when_a_middleware_edits_args_in_place(
    registry: MiddlewareRegistry,
) -> None:
    """tool_execution gets args and original_args: two objects, so an in-place edit of args (no
    tool_request middleware replaced them) leaves original_args, and the caller's dict, as they were."""
    seen: list[Any] = []

    def outer(**kw: Any) -> Any:
        kw["args"]["injected"] = True
        return kw["next_call"](kw["args"])

    registry.register_middleware("tool_execution", outer)
    registry.register_middleware("tool_execution", lambda **kw: seen.append(kw["original_args"]) or kw["next_call"](kw["args"]))
    given = {"command": "ls"}
    result = run_tool(registry, given)
    assert result["args"] == {"command": "ls", "injected": True}
    assert seen == [{"command": "ls"}] and given == {"command": "ls"}


def test_clause_request_middleware_sees_the_full_provider_kwargs(registry: MiddlewareRegistry) -> None:
    request = {
        "model": "gpt-x",
        "input": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "terminal"}}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.2,
        "extra_body": {"provider_specific": 1},
    }
    seen: list[dict[str, Any]] = []
    registry.register_middleware("llm_request", recorder(seen))
    run_llm(registry, request=request)
    assert seen[0]["request"] == request


def test_clause_execution_middleware_gets_the_same_effective_request(registry: MiddlewareRegistry) -> None:
    registry.register_middleware("llm_request", lambda **kw: {"request": {**kw["request"], "model": "m2"}})
    seen: list[dict[str, Any]] = []
    pre: list[dict[str, Any]] = []
    registry.register_hook("pre_api_request", lambda **kw: pre.append(kw["request"]))
    registry.register_middleware("llm_execution", recorder(seen))
    run_llm(registry)
    assert pre[0] == {"method": "POST", "body": seen[0]["request"]}  # the hook's view, as Hermes gives it
    assert seen[0]["request"]["model"] == "m2"
    assert seen[0]["original_request"]["model"] == "gpt-x"
    assert callable(seen[0]["next_call"])


def test_clause_observer_hooks_are_read_only_a_hook_writing_to_its_request_changes_nothing(
    registry: MiddlewareRegistry,
) -> None:
    def scribble(**kw: Any) -> None:
        kw["request"]["body"]["temperature"] = 99
        kw["request"]["body"]["messages"].append({"role": "user", "content": "injected"})

    registry.register_hook("pre_api_request", scribble)
    sent: list[Any] = []
    run_llm(registry, provider=lambda req: sent.append(req) or {"model": "gpt-x", "choices": []})
    assert sent == [{"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}]


def test_clause_observer_hooks_are_read_only_for_tool_calls_each_hook_kind(registry: MiddlewareRegistry) -> None:
    """A pre_tool_call, post_tool_call or transform_tool_result hook writing to its payload (arguments,
    result, context values) changes neither what runs, what is returned, nor what a later hook sees."""
    seen: dict[str, list[Any]] = {"pre": [], "post": [], "transform": [], "policy": []}

    def scribble(name: str):
        def hook(**kw: Any) -> None:
            seen[name].append({"args": copy.deepcopy(kw["args"]), "result": copy.deepcopy(kw.get("result"))})
            kw["args"]["word"] = "x"
            kw["args"]["nested"]["deep"].append("x")
            if isinstance(kw.get("result"), dict):
                kw["result"]["echo"]["word"] = "x"
                kw["result"]["added"] = True
            kw["middleware_trace"].append({"source": "observer"})

        return hook

    for hook_name, key in (("pre_tool_call", "pre"), ("post_tool_call", "post"), ("transform_tool_result", "transform")):
        registry.register_hook(hook_name, scribble(key))
        registry.register_hook(hook_name, scribble(key))  # the second sees what the first was given
    received: list[Any] = []
    args = {"word": "a", "nested": {"deep": []}}
    result = ToolCallFlow(registry, policy=lambda n, a, c: seen["policy"].append(copy.deepcopy(a))).run(
        "terminal",
        args,
        execute=lambda a: received.append(copy.deepcopy(a)) or {"echo": dict(a)},
        context=TOOL_CTX,
    )
    clean = {"word": "a", "nested": {"deep": []}}
    assert received == [clean]  # the tool got the arguments, not the hook's edits
    assert seen["policy"] == [clean]
    assert result == {"echo": clean}  # the edits of post_tool_call and transform_tool_result are gone
    assert args == clean  # the caller's object is untouched
    for key in ("pre", "post", "transform"):
        assert [v["args"] for v in seen[key]] == [clean, clean], key
    assert [v["result"] for v in seen["post"] + seen["transform"]] == [{"echo": clean}] * 4


def test_clause_observer_hooks_are_read_only_for_a_blocked_tool_call(registry: MiddlewareRegistry) -> None:
    registry.register_hook("pre_tool_call", lambda **kw: {"action": "block", "message": "no"})

    def scribble(**kw: Any) -> None:
        kw["result"]["error"] = "changed by an observer"

    registry.register_hook("post_tool_call", scribble)
    assert run_tool(registry) == {"error": "no"}


def test_clause_observer_hooks_are_read_only_for_llm_error_and_response_hooks(registry: MiddlewareRegistry) -> None:
    def scribble(**kw: Any) -> None:
        kw["request"]["body"]["messages"].append({"role": "user", "content": "injected"})
        if isinstance(kw.get("response"), dict):
            kw["response"]["model"] = "changed"

    for hook_name in ("post_api_request", "api_request_error"):
        registry.register_hook(hook_name, scribble)
    request = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}
    response = {"model": "gpt-x", "choices": [{"message": {"role": "assistant", "content": "ok"}}]}
    got = LLMCallFlow(registry).run(request, call_provider=lambda req: response, context=LLM_CTX)
    assert got == {"model": "gpt-x", "choices": [{"message": {"role": "assistant", "content": "ok"}}]}
    assert request == {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}

    def fail(req: Any) -> Any:
        raise RuntimeError("provider down")

    with pytest.raises(RuntimeError):
        LLMCallFlow(registry).run(request, call_provider=fail, context=LLM_CTX)
    assert request == {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}


# -- 执行顺序: 工具调用 ---------------------------------------------------------------------------


def test_clause_tool_call_order(registry: MiddlewareRegistry) -> None:
    order: list[str] = []
    registry.register_middleware("tool_request", lambda **kw: order.append("tool_request"))
    registry.register_hook("pre_tool_call", lambda **kw: order.append("pre_tool_call"))
    registry.register_middleware(
        "tool_execution", lambda **kw: order.append("tool_execution") or kw["next_call"](None)
    )
    registry.register_hook("post_tool_call", lambda **kw: order.append("post_tool_call"))
    registry.register_hook("transform_tool_result", lambda **kw: order.append("transform_tool_result"))
    run_tool(
        registry,
        coerce=lambda name, args: order.append("coerce") or args,
        check_available=lambda *a: order.append("available"),
        policy=lambda *a: order.append("policy"),
        execute=lambda a: order.append("execute"),
    )
    assert order == [
        "coerce",
        "tool_request",
        "available",
        "pre_tool_call",
        "policy",
        "tool_execution",
        "execute",
        "post_tool_call",
        "transform_tool_result",
    ]


def test_clause_transform_tool_result_applies_before_the_result_goes_back(
    registry: MiddlewareRegistry,
) -> None:
    registry.register_hook("transform_tool_result", lambda **kw: None)  # None keeps the result
    registry.register_hook("transform_tool_result", lambda **kw: kw["result"] + " [checked]")
    registry.register_hook("transform_tool_result", lambda **kw: "never: the first non-None wins")
    assert run_tool(registry, execute=lambda a: "out") == "out [checked]"


def test_clause_tool_request_rewrite_is_what_approval_evaluates(registry: MiddlewareRegistry) -> None:
    registry.register_middleware("tool_request", lambda **kw: {"args": {"command": "rm -rf /"}})

    def policy(name: str, args: dict[str, Any], ctx: dict[str, Any]) -> None:
        if "rm" in args["command"]:
            raise PermissionError(f"denied: {args['command']}")

    with pytest.raises(PermissionError, match="rm -rf"):
        run_tool(registry, {"command": "ls"}, policy=policy)


# -- 启用 -----------------------------------------------------------------------------------------


def test_clause_middleware_runs_only_for_enabled_plugins(home: Path) -> None:
    install_example(home, "middleware-demo-terminal-workdir")
    manager = PluginManager(home)
    manager.load()
    assert manager.runtime.empty
    [info] = manager.plugins()
    assert not info.enabled and "not enabled" in (info.error or "")
    enable_plugin(home, "middleware-demo-terminal-workdir")
    manager.reload()
    assert manager.runtime.has_middleware("tool_request")


def test_clause_one_hermes_home_serves_enable_and_run(home: Path) -> None:
    install_example(home, "middleware-demo-llm-tag")
    enable_plugin(None, "middleware-demo-llm-tag")  # None → $HERMES_HOME, as `hermes plugins enable`
    manager = PluginManager()  # and the runtime reads the same $HERMES_HOME
    manager.load()
    assert manager.runtime.has_middleware("llm_request")


# -- 通用插件示例 ---------------------------------------------------------------------------------


def _example_manager(home: Path, name: str) -> PluginManager:
    install_example(home, name)
    enable_plugin(home, name)
    manager = PluginManager(home)
    [info] = manager.load()
    assert info.enabled and info.error is None, info
    return manager


def test_clause_example_llm_request_tag_reaches_pre_api_provider_and_post_api(home: Path) -> None:
    manager = _example_manager(home, "middleware-demo-llm-tag")
    seen: dict[str, Any] = {}
    manager.registry.register_hook("pre_api_request", lambda **kw: seen.setdefault("pre", kw))
    manager.registry.register_hook("post_api_request", lambda **kw: seen.setdefault("post", kw))
    request = {"model": "gpt-x", "messages": [], "extra_body": {"keep": 1}}
    sent: list[dict[str, Any]] = []
    LLMCallFlow(manager).run(request, call_provider=lambda req: sent.append(req) or {"model": "gpt-x"})
    tagged = {"keep": 1, "metadata": {"hermes_middleware_demo": True}}
    pre, post = seen["pre"]["request"], seen["post"]["request"]
    assert pre["method"] == post["method"] == "POST"
    assert sent[0]["extra_body"] == pre["body"]["extra_body"] == post["body"]["extra_body"]
    assert sent[0]["extra_body"] == tagged
    assert request == {"model": "gpt-x", "messages": [], "extra_body": {"keep": 1}}  # caller's dict untouched
    assert seen["pre"]["middleware_trace"] == [
        {"source": "middleware-demo", "reason": "tagged provider request"}
    ]


def test_clause_example_terminal_workdir_is_what_telemetry_and_policy_see(home: Path) -> None:
    manager = _example_manager(home, "middleware-demo-terminal-workdir")
    expected = str(Path.home() / ".hermes" / "cache" / "scratch" / "hermes-middleware-demo")
    seen: dict[str, Any] = {}
    manager.registry.register_hook("pre_tool_call", lambda **kw: seen.setdefault("hook", kw["args"]))
    flow = ToolCallFlow(manager, policy=lambda n, args, c: seen.setdefault("policy", args))
    result = flow.run("terminal", {"command": "ls"}, execute=lambda a: a["workdir"])
    assert result == seen["hook"]["workdir"] == seen["policy"]["workdir"] == expected
    # Other tools are left alone (the middleware returns None).
    assert flow.run("read_file", {"path": "x"}, execute=lambda a: a) == {"path": "x"}


def test_clause_example_llm_timing_returns_the_provider_response_unchanged(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manager = _example_manager(home, "middleware-demo-llm-timing")
    response = object()  # the provider adapter's own shape, whatever it is
    assert LLMCallFlow(manager).run({"model": "m"}, call_provider=lambda req: response) is response
    assert re.fullmatch(r"llm_execution elapsed_ms=\d+\n", capsys.readouterr().out)  # the seed's print


def test_clause_example_tool_annotate_keeps_the_tool_result(home: Path) -> None:
    manager = _example_manager(home, "middleware-demo-tool-annotate")
    result = {"rows": [1, 2]}
    assert ToolCallFlow(manager).run("db", {}, execute=lambda a: result) is result
    import sys

    assert sys.modules["hermes_plugins.middleware_demo_tool_annotate"].CALLS["db"] == 1


def test_clause_next_call_with_modified_args_reaches_later_middleware_and_base(
    registry: MiddlewareRegistry,
) -> None:
    seen: list[dict[str, Any]] = []
    registry.register_middleware("tool_execution", lambda **kw: kw["next_call"]({**kw["args"], "limit": 10}))
    registry.register_middleware("tool_execution", recorder(seen))
    assert run_tool(registry, execute=lambda a: a) == {"command": "ls", "limit": 10}
    assert seen[0]["args"] == {"command": "ls", "limit": 10}
    assert seen[0]["original_args"] == {"command": "ls"}


# -- 安全注意 ------------------------------------------------------------------------------------


def test_clause_request_middleware_returns_full_replacement(registry: MiddlewareRegistry) -> None:
    # A partial "patch" is taken as the whole new payload: there is no merging.
    registry.register_middleware("tool_request", lambda **kw: {"args": {"limit": 1}})
    assert run_tool(registry, {"command": "ls"}, execute=lambda a: a) == {"limit": 1}


def test_clause_request_middleware_other_return_shapes_are_ignored(registry: MiddlewareRegistry) -> None:
    def mutate_in_place(**kw: Any) -> None:
        kw["args"]["command"] = "mutated"
        kw["original_args"]["command"] = "mutated"

    registry.register_middleware("tool_request", mutate_in_place)
    registry.register_middleware("tool_request", lambda **kw: {"args": "not a dict"})
    registry.register_middleware("tool_request", lambda **kw: ["args"])
    seen: list[dict[str, Any]] = []
    registry.register_middleware("tool_request", recorder(seen))
    args = {"command": "ls"}
    assert run_tool(registry, args, execute=lambda a: a) == {"command": "ls"}
    assert seen[0]["original_args"] == {"command": "ls"}  # the original is never mutated
    assert args == {"command": "ls"}


def test_clause_execution_middleware_may_short_circuit(registry: MiddlewareRegistry) -> None:
    ran: list[Any] = []
    registry.register_middleware("tool_execution", lambda **kw: "from cache")
    assert run_tool(registry, execute=lambda a: ran.append(a)) == "from cache"
    assert ran == []


def test_clause_observer_hooks_are_read_only(registry: MiddlewareRegistry) -> None:
    registry.register_hook("post_tool_call", lambda **kw: "ignored")
    registry.register_hook("pre_tool_call", lambda **kw: {"action": "allow"})
    assert run_tool(registry, execute=lambda a: "real") == "real"


def test_clause_warn_once_is_per_callback_even_when_two_share_a_name(
    registry: MiddlewareRegistry, logs: list
) -> None:
    def make() -> Any:
        def cb(**kw: Any) -> Any:
            return kw["not_sent_field"]

        return cb

    registry.register_middleware("tool_request", make())
    registry.register_middleware("tool_request", make())  # same module.qualname, another callback
    run_tool(registry)
    run_tool(registry)
    assert len(warnings_of(logs)) == 2  # each callback's first failure warns; the repeats are DEBUG
