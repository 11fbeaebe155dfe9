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
    opts = load_settings(home.path).agent_plugin
    assert opts == Options(url="redis://cfg:6379/1", route_llm=True, principal="alice", timeout=30.0)
    monkeypatch.setenv("HERMES_GATEWAY_URL", "redis://env:6379/2")
    monkeypatch.setenv("HERMES_GATEWAY_ROUTE_LLM", "0")
    opts = load_settings(home.path).agent_plugin
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
    from broker.calls import read_record

    install_example(home.path, "middleware-demo-llm-tag")
    enable_plugin(home.path, "middleware-demo-llm-tag")
    enable_plugin(home.path, "hermes-gateway")  # ours is never named: it runs nothing on the workers
    home.echo_tool()
    gateway.sync_tools()
    bridge = Bridge(Options(url=None, timeout=0.3), load_settings(home.path))
    bridge._gw = gateway
    submitted: list[Any] = []
    submit = gateway.call_tool

    def recording(*a: Any, **kw: Any) -> Any:
        handle = submit(*a, **kw)
        rec = read_record(conn, handle.call_id)  # (read while pending: an ended call keeps no envelope)
        submitted.append(rec["envelope"] if rec else None)
        return handle

    monkeypatch.setattr(gateway, "call_tool", recording)
    bridge.call("echo", {}, {"session_id": "s1"})
    assert submitted[0] is not None and submitted[0].context["plugins_applied"] == "middleware-demo-llm-tag"
    # With a tool prefix Hermes saw `gw_echo`, so a plugin matching `echo` by name never applied there:
    # the workers are not told to skip any (else such a rewrite or guardrail would apply nowhere).
    prefixed = Bridge(Options(url=None, timeout=0.3, tool_prefix="gw_"), load_settings(home.path))
    prefixed._gw = gateway
    assert [name for name, _ in prefixed.tools()] == ["gw_echo"]
    prefixed.call("gw_echo", {}, {"session_id": "s1"})
    assert submitted[1] is not None and submitted[1].tool == "echo"
    assert "plugins_applied" not in submitted[1].context


def _bridge(home: Home, gateway: Any, timeout: float = 30.0) -> Bridge:
    bridge = Bridge(Options(url=None, timeout=timeout), load_settings(home.path))
    bridge._gw = gateway
    return bridge


def test_with_no_worker_listening_a_tool_call_and_a_routed_llm_turn_are_refused_at_once(
    home: Home, redis_url: str
) -> None:
    import time

    from broker import keys
    from broker.errors import NoWorkers
    from hermes_gateway.client import Gateway

    home.sleep_tool()
    bridge = Bridge(Options(url=redis_url, timeout=600), load_settings(home.path))  # connects as in the agent
    try:
        bridge.gw.sync_tools()
        started = time.monotonic()
        out = bridge.call("sleep", {"seconds": 1}, {"session_id": "s1"})
        assert out.startswith('{"error": "no_workers: no worker listens on queue \'tools\''), out
        with pytest.raises(NoWorkers, match="no worker listens on queue 'llm'"):
            bridge.llm_execution(request={"model": "m", "messages": []}, next_call=None, session_id="s1")
        assert time.monotonic() - started < 5  # not the 600 s timeout
        assert isinstance(bridge.gw, Gateway) and not bridge.gw.conn.keys(keys.job("*"))  # nothing queued
    finally:
        bridge.close()


def test_a_call_the_agent_interrupts_is_cancelled(home: Home, gateway: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from hermes_gateway.hermes_plugin import bridge as bridge_mod

    home.sleep_tool()
    gateway.sync_tools()  # no worker: the call waits, pending
    bridge = _bridge(home, gateway)
    handles = _recorded(gateway, monkeypatch)
    asked = time.monotonic() + 0.4
    monkeypatch.setattr(bridge_mod, "agent_interrupted", lambda: time.monotonic() > asked)  # Hermes' flag
    out = bridge.call("sleep", {"seconds": 1}, {"session_id": "s1"})
    assert out.startswith('{"error": "cancelled: ') and "interrupted by the agent" in out, out
    assert gateway.calls.record(handles[0].call_id)["state"] == "cancelled"


def test_a_call_whose_wait_ends_by_keyboard_interrupt_or_an_error_is_cancelled(
    home: Home, gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import _thread
    import threading

    home.sleep_tool()
    gateway.sync_tools()
    bridge = _bridge(home, gateway)
    handles = _recorded(gateway, monkeypatch)
    import signal

    # (interrupt_main does nothing while SIGINT is ignored, as in a run started as a background job)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.4, _thread.interrupt_main).start()  # Ctrl-C in the agent while the tool runs
        with pytest.raises(KeyboardInterrupt):
            bridge.call("sleep", {"seconds": 1}, {"session_id": "s1"})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert gateway.calls.record(handles[0].call_id)["state"] == "cancelled"

    # An error out of the wait (a routed LLM turn's, here) cancels it too.
    from hermes_gateway.handle import CallHandle

    def broken(self: Any, timeout: float | None = None) -> Any:
        raise RuntimeError("the connection broke")

    calls: list[Any] = []
    submit = gateway.call_llm
    monkeypatch.setattr(gateway, "call_llm", lambda *a, **kw: calls.append(submit(*a, **kw)) or calls[-1])
    monkeypatch.setattr(CallHandle, "result", broken)
    with pytest.raises(RuntimeError):
        bridge.llm_execution(request={"model": "m", "messages": []}, next_call=None, session_id="s1")
    assert gateway.calls.record(calls[0].call_id)["state"] == "cancelled"


def test_the_agent_exiting_cancels_the_calls_it_still_waits_on(
    home: Home, gateway: Any, monkeypatch: pytest.MonkeyPatch, wait_until: Any
) -> None:
    import threading

    home.sleep_tool()
    gateway.sync_tools()
    bridge = _bridge(home, gateway)
    handles = _recorded(gateway, monkeypatch)
    out: list[str] = []
    waiter = threading.Thread(target=lambda: out.append(bridge.call("sleep", {"seconds": 1}, {})), daemon=True)
    waiter.start()
    wait_until(lambda: bridge._waiting, message="the call to be waited on")
    bridge._gw = None  # (the gateway fixture closes its own client)
    with bridge._waiting_lock:
        waiting = list(bridge._waiting)
    bridge.close()  # what atexit runs when the agent exits
    assert [h.call_id for h in waiting] == [handles[0].call_id]
    assert gateway.calls.record(handles[0].call_id)["state"] == "cancelled"
    waiter.join(10)
    assert out and out[0].startswith('{"error": "cancelled')
