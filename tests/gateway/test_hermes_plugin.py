"""The Hermes agent plugin's own parts, without Hermes: options, request and response shapes, the guard."""

from __future__ import annotations

from typing import Any

import pytest

from broker.config import load_settings
from hermes_gateway import hermes_plugin
from hermes_gateway.hermes_plugin.bridge import Bridge, Options, as_completion, request_body
from middleware import PluginManager, enable_plugin
from tests.conftest import Home
from tests.middleware.helpers import install_example


def test_options_come_from_the_plugin_entry_and_the_environment_wins(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = {"redis_url": "redis://cfg:6379/1", "route_llm": True, "principal": "alice", "timeout": 30}
    home.config({"plugins": {"enabled": ["hermes-gateway"], "entries": {"hermes-gateway": entry}}})
    opts = Options.load(load_settings(home.path))
    assert opts == Options(url="redis://cfg:6379/1", route_llm=True, principal="alice", timeout=30.0)
    monkeypatch.setenv("HERMES_GATEWAY_URL", "redis://env:6379/2")
    monkeypatch.setenv("HERMES_GATEWAY_ROUTE_LLM", "0")
    opts = Options.load(load_settings(home.path))
    assert opts.url == "redis://env:6379/2" and opts.route_llm is False


def test_request_body_keeps_what_can_travel_and_drops_client_settings() -> None:
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "timeout": 30.0,
        "client": object(),
    }
    assert request_body(request) == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_completion_dict_reads_by_attribute_as_hermes_expects() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    response = {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "finish_reason": "tool_calls",
            }
        ],
    }
    out = as_completion(response)
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert out.choices[0].finish_reason == "tool_calls" and out.model == "m"


class _Recorder:
    """A Hermes-like context: the class has register_tool, as hermes_cli.plugins.PluginContext does."""

    def __init__(self) -> None:
        self.tools: list[str] = []
        self.middleware: list[str] = []

    def register_tool(self, name: str, **kw: Any) -> None:
        self.tools.append(name)

    def register_middleware(self, kind: str, callback: Any) -> None:
        self.middleware.append(kind)


def test_in_the_agent_it_registers_each_tool_and_its_middleware(
    monkeypatch: pytest.MonkeyPatch, home: Home
) -> None:
    schema = {"name": "get_weather", "description": "d", "parameters": {"type": "object", "properties": {}}}
    monkeypatch.setattr(Bridge, "tools", lambda self: [("get_weather", schema)])
    monkeypatch.setenv("HERMES_GATEWAY_URL", "redis://127.0.0.1:6379/9")
    monkeypatch.setenv("HERMES_GATEWAY_ROUTE_LLM", "1")
    ctx = _Recorder()
    hermes_plugin.register(ctx)
    assert ctx.tools == ["get_weather"] and ctx.middleware == ["tool_execution", "llm_execution"]


def test_without_a_gateway_url_it_registers_nothing(monkeypatch: pytest.MonkeyPatch, home: Home) -> None:
    for var in ("HERMES_GATEWAY_URL", "HERMES_REDIS_URL"):
        monkeypatch.delenv(var, raising=False)
    ctx = _Recorder()
    hermes_plugin.register(ctx)
    assert ctx.tools == [] and ctx.middleware == []


def test_our_own_workers_load_it_as_a_no_op_so_llm_calls_cannot_loop(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_GATEWAY_URL", "redis://127.0.0.1:6379/9")
    monkeypatch.setenv("HERMES_GATEWAY_ROUTE_LLM", "1")
    enable_plugin(home.path, "hermes-gateway")
    manager = PluginManager(home.path)
    infos = {i.name: i for i in manager.load()}
    info = infos["hermes-gateway"]
    assert info.enabled and info.source == "entrypoint"
    assert info.middleware == () and info.hooks == ()  # the worker's registry got nothing to run


def _recorded(gateway: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The handles of the tool calls the bridge submits."""
    handles: list[Any] = []
    submit = gateway.call_tool
    monkeypatch.setattr(gateway, "call_tool", lambda *a, **kw: handles.append(submit(*a, **kw)) or handles[-1])
    return handles


def test_a_tool_call_the_agent_stops_waiting_for_is_cancelled_not_left_to_run(
    home: Home, gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    home.sleep_tool()
    gateway.sync_tools()  # no worker serves its queue: the call can only wait
    bridge = Bridge(Options(url=None, timeout=0.3), load_settings(home.path))
    bridge._gw = gateway
    handles = _recorded(gateway, monkeypatch)
    out = bridge.call("sleep", {"seconds": 1}, {"session_id": "s1"})
    assert out.startswith('{"error": "timeout: no result for call ')
    assert gateway.calls.record(handles[0].call_id)["state"] == "cancelled"  # the record, not pub/sub's news


def test_calls_name_the_plugins_the_agent_runs_itself(
    home: Home, gateway: Any, conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.records import read_record

    install_example(home.path, "middleware-demo-llm-tag")
    enable_plugin(home.path, "middleware-demo-llm-tag")
    enable_plugin(home.path, "hermes-gateway")  # ours is never named: it runs nothing on the workers
    home.echo_tool()
    gateway.sync_tools()
    bridge = Bridge(Options(url=None, timeout=0.3), load_settings(home.path))
    bridge._gw = gateway
    handles = _recorded(gateway, monkeypatch)
    bridge.call("echo", {}, {"session_id": "s1"})
    record = read_record(conn, handles[0].call_id)
    assert record is not None and record["envelope"].context["plugins_applied"] == "middleware-demo-llm-tag"
