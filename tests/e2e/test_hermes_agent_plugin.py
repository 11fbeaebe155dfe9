"""The real Hermes agent (hermes-agent 0.19.0 from PyPI, its own venv) with our ``hermes-gateway`` plugin,
and without it, reaching the directory through ``hermes-gateway mcp serve`` in its ``mcp_servers``.

``hermes plugins enable hermes-gateway`` then ``hermes chat -q ... -Q`` against the local LLM server:
the model's ``get_weather`` call runs on our worker processes (events, audit record, the agent's ids in
the call context) and its result comes back into the conversation. With ``HERMES_GATEWAY_ROUTE_LLM=1``
the agent's own provider calls travel the ``llm`` queue too. The agent's venv is made
by the README's install, ``pip install 'hermes-agent[mcp]==0.19.0' hermes-gateway`` (this checkout).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker import events, keys
from broker.audit import AuditLog, AuditRecord
from broker.calls import Calls, envelope_of
from middleware import enable_plugin
from tests.conftest import Home
from tests.hermes_agent_venv import HERMES_VERSION, documented_venv
from tests.llm_server import LLMServer, Reply

# One xdist worker runs the modules that use the agent's venv (this one and
# tests/middleware/test_interop_hermes_agent.py): it is built once (under a lock), not waited for twice.
pytestmark = [pytest.mark.interop, pytest.mark.e2e, pytest.mark.xdist_group("hermes-agent-documented")]


@pytest.fixture(autouse=True)
def _whole_histories(keep_history: None) -> None:
    """These tests read ended calls' envelopes and stream deltas from Redis (workers.keep_history)."""

MODEL = "hermes-test"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
AGENT_MCP = "1.26.0"  # what hermes-agent[mcp] pins for its own MCP client


@pytest.fixture(scope="module")
def hermes_bin(request: pytest.FixtureRequest) -> Path:
    """``hermes`` of the venv made by the README's install (tests/hermes_agent_venv.py)."""
    return documented_venv(request) / "bin" / "hermes"


@pytest.fixture
def llm(home: Home, gateway: Any) -> Iterator[LLMServer]:
    """The LLM server; the workers' config points at it and the directory has a python get_weather."""
    with LLMServer(model=MODEL) as server:
        home.config({"model": {"provider": "openai-compatible", "base_url": server.base_url, "model": MODEL}})
        home.tool(
            "get_weather",
            function="hermes_gateway.demo_tools:weather",
            description="Current weather in a city",
            input_schema=WEATHER_SCHEMA,
        )
        gateway.sync_tools()
        yield server


class Agent:
    """A HERMES_HOME for the agent (its own config, not the workers'), and its commands."""

    def __init__(self, binary: Path, root: Path, server: LLMServer, redis_url: str) -> None:
        self.binary = binary
        self.root = root
        root.mkdir()
        model = {"provider": "custom", "base_url": server.base_url, "default": MODEL, "api_key": "sk-test"}
        (root / "config.yaml").write_text(yaml.safe_dump({"model": model}))
        self.env = {"PATH": os.environ.get("PATH", ""), "HERMES_HOME": str(root), "HOME": str(root)}
        self.env["HERMES_REDIS_URL"] = redis_url

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        proc = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=self.root,
            env={**self.env, **env},
            stdin=subprocess.DEVNULL,
        )
        print(f"hermes {' '.join(args[:2])}: {time.monotonic() - started:.1f}s")
        assert proc.returncode == 0, f"hermes {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        return proc


@pytest.fixture
def agent(hermes_bin: Path, tmp_path: Path, llm: LLMServer, redis_url: str) -> Agent:
    agent = Agent(hermes_bin, tmp_path / "agent-home", llm, redis_url)
    agent.run("plugins", "enable", "hermes-gateway")  # the documented command, non-interactive
    assert yaml.safe_load((agent.root / "config.yaml").read_text())["plugins"]["enabled"] == [
        "hermes-gateway"
    ]
    return agent


def records(conn: Any) -> list[AuditRecord]:
    return sorted(AuditLog(conn).list(), key=lambda r: r.ts)


def session_of(out: str) -> str:
    found = re.search(r"session_id:\s*(\S+)", out)
    assert found, out
    return found.group(1)


def test_hermes_chat_calls_a_gateway_tool_that_runs_on_our_workers(
    agent: Agent, llm: LLMServer, workers: Any, conn: Any
) -> None:
    workers(queues="tools")
    proc = agent.run("chat", "-q", "What is the weather in Berlin?", "-Q")
    out = proc.stdout + proc.stderr

    [record] = [r for r in records(conn) if r.kind == "tool"]
    assert record.tool_name == "get_weather" and record.state == "done" and record.args == {"city": "Berlin"}
    result = Calls(conn).record(record.call_id)["result"]
    assert result["city"] == "Berlin" and "'temperature'" in (record.result_summary or "")
    assert f"Tool result: {json.dumps(result, ensure_ascii=False)}" in proc.stdout  # back in the conversation
    # The agent's session, turn and tool-call ids rode into the call.
    assert record.session_id == session_of(out)
    context = envelope_of(conn.hget(keys.job(record.call_id), "data")).context
    assert context["turn_id"] and context["task_id"] and context["api_request_id"]
    offered, answered = llm.chat_requests
    assert "get_weather" in [t["function"]["name"] for t in offered.body["tools"]]
    [tool_msg] = [m for m in answered.body["messages"] if m["role"] == "tool"]
    assert record.tool_call_id == context["tool_call_id"] == tool_msg["tool_call_id"]
    states = [e.state for e in events.history(conn, record.call_id) if e.type == events.TRANSITION]
    assert states == ["pending", "routing", "executing", "formatting", "done"]
    assert "x-hermes-call-id" not in offered.headers  # the agent called its provider itself


def test_hermes_own_mcp_setting_in_the_agents_config_leaves_the_plugin_working(
    agent: Agent, llm: LLMServer, workers: Any, conn: Any
) -> None:
    # The plugin reads the agent's config.yaml: Hermes' own keys there (its mcp: section) are Hermes' to read.
    agent.run("config", "set", "mcp.auto_reload_on_config_change", "false")
    workers(queues="tools")
    proc = agent.run("chat", "-q", "What is the weather in Berlin?", "-Q")

    offered = llm.chat_requests[0]
    assert "get_weather" in [t["function"]["name"] for t in offered.body.get("tools") or []], proc.stderr[-3000:]
    [record] = [r for r in records(conn) if r.kind == "tool"]
    assert record.tool_name == "get_weather" and record.state == "done"


LOADED = """
import json
from hermes_cli.plugins import discover_plugins, get_plugin_manager
discover_plugins()
print(json.dumps([p for p in get_plugin_manager().list_plugins() if p["name"] == "hermes-gateway"]))
"""


def test_a_model_named_alone_in_the_agents_config_leaves_the_plugin_working(
    agent: Agent, hermes_bin: Path
) -> None:
    # Hermes' other spelling of model: (its "new format"), the model's name alone.
    config = yaml.safe_load((agent.root / "config.yaml").read_text())
    (agent.root / "config.yaml").write_text(yaml.safe_dump({**config, "model": MODEL}))
    proc = subprocess.run(
        [str(hermes_bin.parent / "python"), "-c", LOADED], capture_output=True, text=True, timeout=120,
        env=agent.env, cwd=agent.root,
    )
    [plugin] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plugin["enabled"] and plugin["error"] is None and plugin["tools"] == 1, plugin


def test_a_tool_whose_prefixed_name_no_provider_takes_is_left_out_and_the_others_work(
    agent: Agent, llm: LLMServer, home: Home, gateway: Any, workers: Any, conn: Any
) -> None:
    # Providers take function names of at most 64 of [A-Za-z0-9_-] and refuse the whole request over one
    # longer: a valid 62-character gateway name with the prefix would have broken every turn of the agent.
    home.echo_tool("lookup_" + "x" * 55)
    gateway.sync_tools()
    workers(queues="tools")
    agent.run("chat", "-q", "What is the weather in Berlin?", "-Q", HERMES_GATEWAY_TOOL_PREFIX="gw__")

    names = [t["function"]["name"] for t in llm.chat_requests[0].body["tools"]]
    assert "gw__get_weather" in names and max(map(len, names)) <= 64, names
    [record] = [r for r in records(conn) if r.kind == "tool"]
    assert record.tool_name == "get_weather" and record.state == "done"


def test_route_llm_sends_the_agents_provider_calls_through_the_llm_queue(
    agent: Agent, llm: LLMServer, workers: Any, conn: Any
) -> None:
    workers(queues="tools,llm")
    proc = agent.run("chat", "-q", "What is the weather in Paris?", "-Q", HERMES_GATEWAY_ROUTE_LLM="1")

    session = session_of(proc.stdout + proc.stderr)
    first, tool, second = records(conn)
    assert (first.kind, tool.kind, second.kind) == ("llm", "tool", "llm")
    assert {first.session_id, tool.session_id, second.session_id} == {session}
    assert 'Tool result: {"city": "Paris"' in proc.stdout
    # Each provider request the server saw came from a worker running that LLM call.
    assert [r.headers.get("x-hermes-call-id") for r in llm.chat_requests] == [first.call_id, second.call_id]
    context = envelope_of(conn.hget(keys.job(tool.call_id), "data")).context
    assert context["parent_call_id"] == first.call_id
    deltas = [e for e in events.history(conn, second.call_id) if e.type == events.DELTA]
    assert "".join(d.detail.get("content", "") for d in deltas).startswith("Tool result:")


# Hermes' own llm_execution chain with our bridge in it; its terminal call (the agent calling the provider
# itself) only counts. Prints what the chain returned and how often the terminal call ran.
HERMES_CHAIN = """
import json
from hermes_cli.middleware import run_llm_execution_middleware
from hermes_cli.plugins import get_plugin_manager
from broker.config import load_settings
from hermes_gateway.hermes_plugin import Bridge

settings = load_settings()
bridge = Bridge(settings.agent_plugin, settings)
get_plugin_manager()._middleware.setdefault("llm_execution", []).append(bridge.llm_execution)
direct = []
response = run_llm_execution_middleware(
    {"model": "hermes-test", "messages": [{"role": "user", "content": "hi"}]}, direct.append,
    session_id="s-1", api_mode="chat_completions", provider="custom",
)
print(json.dumps({"direct": len(direct), **{k: getattr(response, k, None) for k in ("choices", "error")}}))
bridge.close()
"""


def test_a_routed_llm_call_that_fails_on_the_gateway_is_not_sent_again_by_the_agent_itself(
    hermes_bin: Path, llm: LLMServer, workers: Any, redis_url: str, home: Home, tmp_path: Path
) -> None:
    # A raise from llm_execution makes Hermes call the provider itself: a call the gateway ran and failed (or
    # refused: a budget, a limit) was sent again behind the fleet's limits, budgets and audit.
    llm.script(Reply(status=400, error="bad messages"))
    workers(queues="llm")
    env = {"PATH": os.environ.get("PATH", ""), "HERMES_HOME": str(home.path), "HERMES_REDIS_URL": redis_url}
    proc = subprocess.run(
        [str(hermes_bin.parent / "python"), "-c", HERMES_CHAIN], capture_output=True, text=True, timeout=120,
        env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["direct"] == 0 and len(llm.chat_requests) == 1  # the worker's request only
    # What Hermes reads as a failed provider answer (no choices, the error and its status): it reports it.
    assert out["choices"] == [] and out["error"]["code"] == 400
    assert "HTTP 400: bad messages" in out["error"]["message"]


# Not idempotent on purpose: run twice, it leaves two notes and two "!".
NOTER = """
def register(ctx):
    ctx.register_middleware("llm_request", note)
    ctx.register_middleware("tool_request", shout)


def note(**kwargs):
    request = dict(kwargs["request"])
    request["messages"] = [{"role": "system", "content": "POLICY NOTE"}] + list(request.get("messages") or [])
    return {"request": request, "source": "noter", "reason": "added the policy note"}


def shout(**kwargs):
    if kwargs.get("tool_name") != "get_weather":
        return None
    return {"args": {**kwargs["args"], "city": kwargs["args"]["city"] + "!"}, "source": "noter"}
"""


def _install_noter(home: Path) -> None:
    plugin = home / "plugins" / "noter"
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text("name: noter\nversion: '1.0'\n")
    (plugin / "__init__.py").write_text(NOTER)


def test_a_plugin_enabled_for_the_agent_and_the_workers_runs_once_per_call(
    agent: Agent, llm: LLMServer, home: Home, workers: Any, conn: Any
) -> None:
    # The same plugin enabled on both sides (as with one shared HERMES_HOME): Hermes runs it around
    # the calls it makes, names it in the calls' context, and our workers skip it for those calls.
    _install_noter(agent.root)
    agent.run("plugins", "enable", "noter")
    _install_noter(home.path)
    enable_plugin(home.path, "noter")
    workers(queues="tools,llm")
    agent.run("chat", "-q", "What is the weather in Paris?", "-Q", HERMES_GATEWAY_ROUTE_LLM="1")

    first, tool, second = records(conn)
    assert tool.args == {"city": "Paris!"}  # one "!": the agent's tool_request ran, the worker's did not
    for request in llm.chat_requests:  # each provider request has the agent's note once
        notes = [m for m in request.body["messages"] if m.get("content") == "POLICY NOTE"]
        assert len(notes) == 1, request.body["messages"]
    context = envelope_of(conn.hget(keys.job(tool.call_id), "data")).context
    assert "noter" in context["plugins_applied"].split(",")


def test_hermes_reaches_the_gateways_tools_as_an_mcp_server_without_the_plugin(
    hermes_bin: Path, tmp_path: Path, llm: LLMServer, redis_url: str, home: Home, workers: Any, conn: Any
) -> None:
    # No plugin: the agent's own MCP client starts `hermes-gateway mcp serve` from its mcp_servers config.
    agent = Agent(hermes_bin, tmp_path / "agent-home", llm, redis_url)
    config = yaml.safe_load((agent.root / "config.yaml").read_text())
    ours = Path(sys.executable).parent / "hermes-gateway"  # ours, with every dependency (not the agent's venv)
    config["mcp_servers"] = {
        "gateway": {
            "command": str(ours),
            "args": ["mcp", "serve", "--principal", "hermes"],
            "env": {"HERMES_REDIS_URL": redis_url, "HERMES_HOME": str(home.path), "PATH": os.environ.get("PATH", "")},
        }
    }
    (agent.root / "config.yaml").write_text(yaml.safe_dump(config))
    workers(queues="tools")
    proc = agent.run("chat", "-q", "What is the weather in Berlin?", "-Q")

    [record] = [r for r in records(conn) if r.kind == "tool"]
    assert record.tool_name == "get_weather" and record.state == "done" and record.args == {"city": "Berlin"}
    assert record.principal == "hermes"  # the principal `mcp serve` runs its calls as
    offered, answered = llm.chat_requests
    assert "mcp__gateway__get_weather" in [t["function"]["name"] for t in offered.body["tools"]]
    [tool_msg] = [m for m in answered.body["messages"] if m["role"] == "tool"]
    assert '"city": "Berlin"' in tool_msg["content"]
    assert 'Tool result:' in proc.stdout and "Berlin" in proc.stdout


def test_hermes_reaches_the_gateways_tools_at_mcp_on_serve_with_a_token(
    hermes_bin: Path, tmp_path: Path, llm: LLMServer, redis_url: str, home: Home, workers: Any, conn: Any
) -> None:
    # The README's config for an agent on another machine: `url` + `headers`, no process of ours started
    # by the agent; its token's principal is who the calls run as.
    from tests.e2e.served import Serve, sha

    token = "remote-agent-token"
    config = yaml.safe_load((home.path / "config.yaml").read_text())
    home.config({**config, "api": {"tokens": {sha(token): {"principal": "remote-hermes"}}}})
    server = Serve(home, redis_url)
    try:
        agent = Agent(hermes_bin, tmp_path / "agent-home", llm, redis_url)
        agent_config = yaml.safe_load((agent.root / "config.yaml").read_text())
        agent_config["mcp_servers"] = {
            "gateway": {"url": server.url, "headers": {"Authorization": f"Bearer {token}"}, "timeout": 60}
        }
        # Hermes discovers MCP tools in the background and waits mcp_discovery_timeout (1.5 s) for them
        # before the first turn: a remote gateway (here a loaded test machine) may take longer to answer.
        agent_config["mcp_discovery_timeout"] = 30
        (agent.root / "config.yaml").write_text(yaml.safe_dump(agent_config))
        workers(queues="tools")
        proc = agent.run("chat", "-q", "What is the weather in Berlin?", "-Q")
    finally:
        server.stop()

    tool_records = [r for r in records(conn) if r.kind == "tool"]
    assert len(tool_records) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    [record] = tool_records
    assert record.tool_name == "get_weather" and record.state == "done" and record.args == {"city": "Berlin"}
    assert record.principal == "remote-hermes"  # the token's principal
    offered, answered = llm.chat_requests
    assert "mcp__gateway__get_weather" in [t["function"]["name"] for t in offered.body["tools"]]
    [tool_msg] = [m for m in answered.body["messages"] if m["role"] == "tool"]
    assert '"city": "Berlin"' in tool_msg["content"]
    assert "Berlin" in proc.stdout


def test_the_documented_install_resolves_beside_the_agents_mcp_and_says_what_needs_the_extra(
    hermes_bin: Path, home: Home
) -> None:
    bin_dir = hermes_bin.parent
    python = str(bin_dir / "python")

    def version(dist: str) -> str:
        code = f"import importlib.metadata as m; print(m.version({dist!r}))"
        return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    assert version("mcp") == AGENT_MCP and version("hermes-agent") == HERMES_VERSION
    checked = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert "hermes-gateway" not in checked.stdout, checked.stdout  # nothing of ours is unmet
    # The plugin loads there (it needs no MCP SDK) ...
    subprocess.run([python, "-c", "import hermes_gateway.hermes_plugin"], check=True, timeout=60)
    # ... and what needs the SDK 2.x says so at once, naming the extra.
    env = {"PATH": os.environ.get("PATH", ""), "HERMES_HOME": str(home.path)}
    served = subprocess.run(
        [str(bin_dir / "hermes-gateway"), "mcp", "serve"], capture_output=True, text=True, timeout=60, env=env,
        stdin=subprocess.DEVNULL,
    )
    assert served.returncode == 2, served.stderr
    assert "needs the MCP SDK 2.x (mcp 1.26.0 is installed, not 2.x): pip install 'hermes-gateway[mcp]'" in served.stderr


def test_with_no_worker_listening_the_agents_tool_call_fails_at_once_naming_the_queue(
    agent: Agent, llm: LLMServer, conn: Any
) -> None:
    started = time.monotonic()
    proc = agent.run("chat", "-q", "What is the weather in Berlin?", "-Q")  # no worker runs anywhere
    took = time.monotonic() - started
    assert "no_workers: no worker listens on queue 'tools'" in proc.stdout, proc.stdout + proc.stderr
    offered, answered = llm.chat_requests
    [tool_msg] = [m for m in answered.body["messages"] if m["role"] == "tool"]
    assert "no_workers: no worker listens on queue 'tools'" in tool_msg["content"]  # the model was told
    assert not conn.keys(keys.job("*"))  # nothing was queued to run later for nobody
    print(f"hermes chat with no worker: {took:.1f}s")
    assert took < 120  # the whole chat, not the plugin's 600 s wait


INTERRUPT_SCRIPT = """
import json, sys, threading, time
from tools.interrupt import set_interrupt  # Hermes' own per-thread interrupt flag
from broker.config import load_settings
from broker.connection import from_url
from hermes_gateway.hermes_plugin.bridge import Bridge, Options

bridge = Bridge(Options(url=sys.argv[1], timeout=120), load_settings())
out = {}
def tool_thread():
    out["result"] = bridge.call("nap", {"seconds": 30}, {"session_id": "s-int"})
t = threading.Thread(target=tool_thread)
started = time.monotonic()
t.start()
conn = from_url(sys.argv[1])
def executing():
    return any(conn.hmget(k, "h_tool", "h_state") == [b"nap", b"executing"] for k in conn.scan_iter("rq:job:*"))
while not executing():  # until the call is running on a worker
    assert time.monotonic() - started < 30, "the call never ran"
    time.sleep(0.02)
set_interrupt(True, t.ident)  # what Hermes does to the thread of a tool when the user interrupts
t.join(60)
out["took"] = time.monotonic() - started
bridge.close()
print(json.dumps(out))
"""


def test_a_tool_call_the_real_agent_interrupts_is_cancelled_on_the_worker(
    hermes_bin: Path, home: Home, gateway: Any, workers: Any, conn: Any, redis_url: str
) -> None:
    home.sleep_tool("nap")
    gateway.sync_tools()
    workers(queues="tools")
    env = {"PATH": os.environ.get("PATH", ""), "HERMES_HOME": str(home.path)}
    proc = subprocess.run(
        [str(hermes_bin.parent / "python"), "-c", INTERRUPT_SCRIPT, redis_url],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["result"].startswith('{"error": "cancelled: ') and "interrupted by the agent" in out["result"], out
    assert out["took"] < 15  # not the 30 s the tool sleeps
    [record] = [r for r in records(conn) if r.tool_name == "nap"]
    assert record.state == "cancelled" and record.session_id == "s-int"  # stopped on the worker, audited
