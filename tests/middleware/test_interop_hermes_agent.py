"""Interop with the real Hermes agent (hermes-agent on PyPI), installed in its own virtualenv.

(a) our example plugins load and run in Hermes' own plugin manager and middleware dispatch
    (``hermes_cli.plugins`` / ``hermes_cli.middleware``), enabled by *our* config.yaml writer;
    ``hermes plugins enable`` (Hermes' ``cmd_enable``) writes a config our loader reads;
(b) Hermes-style plugins, including Hermes' own bundled ``security-guidance`` plugin, run unchanged
    in our PluginManager and give the same results as in Hermes.

The venv is the one the README's install makes (``pip install 'hermes-agent[mcp]==0.19.0' hermes-gateway``,
tests/hermes_agent_venv.py), cached under /tmp/hermes-interop-venv/; the install time is reported. Our
package there changes nothing these scripts run: Hermes loads an entry-point plugin (ours) only when
``plugins.enabled`` names it, and the example plugins import nothing of ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from middleware import PluginManager, ToolCallFlow, disable_plugin, enable_plugin, list_plugins
from tests.hermes_agent_venv import documented_venv
from tests.middleware.helpers import EXAMPLES, install_example, write_plugin

# The group of tests/e2e/test_hermes_agent_plugin.py: one xdist worker runs both modules, which share the
# agent's venv; it is built once (under a lock), not waited for by a second worker.
pytestmark = [pytest.mark.interop, pytest.mark.xdist_group("hermes-agent-documented")]

EXAMPLE_NAMES = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())

# A plugin in the Hermes style: keyword signatures as Hermes' call sites send them, **kwargs for the rest.
HERMES_STYLE_PLUGIN = """
SEEN = []


def register(ctx):
    ctx.register_middleware("tool_request", redact_secrets)
    ctx.register_middleware("tool_execution", add_footer)
    ctx.register_hook("pre_tool_call", refuse_rm)
    ctx.register_hook("transform_tool_result", upper)


def redact_secrets(tool_name, args, original_args, telemetry_schema_version, middleware_schema_version, **kwargs):
    SEEN.append(("tool_request", middleware_schema_version, kwargs.get("session_id")))
    if "token" not in args:
        return None
    return {"args": {**args, "token": "***"}, "source": "hermes-style", "reason": "redacted token"}


def add_footer(tool_name, args, next_call, **kwargs):
    result = next_call(args)
    return result + " | footer"


def refuse_rm(tool_name="", args=None, middleware_trace=None, **kwargs):
    SEEN.append(("pre_tool_call", [e.get("source") for e in middleware_trace or []]))
    if "rm" in str((args or {}).get("command", "")):
        return {"action": "block", "message": "rm is not allowed"}
    return None


def upper(tool_name="", args=None, result=None, **kwargs):
    return result.upper() if isinstance(result, str) else None
"""


@pytest.fixture(scope="module")
def hermes_python(request: pytest.FixtureRequest) -> Path:
    """The python of the agent's venv (tests/hermes_agent_venv.py): the README's install, shared with
    tests/e2e/test_hermes_agent_plugin.py, so a test run builds one hermes-agent venv, not two."""
    return documented_venv(request) / "bin" / "python"


def run_in_hermes(python: Path, home: Path, script: str, **env: str) -> dict[str, Any]:
    """Run ``script`` with the Hermes venv's python; it prints one JSON object as its last line."""
    proc = subprocess.run(
        [str(python), "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(home),
        env={
            "PATH": os.environ.get("PATH", ""),
            "HERMES_HOME": str(home),
            "HOME": os.environ["HOME"],
            **env,
        },
    )
    assert proc.returncode == 0, f"hermes script failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


HERMES_RUN_EXAMPLES = """
import json, sys
from hermes_cli import plugins
from hermes_cli.middleware import (
    apply_llm_request_middleware, apply_tool_request_middleware,
    run_llm_execution_middleware, run_tool_execution_middleware,
)

plugins.discover_plugins(force=True)
listing = {p["name"]: p for p in plugins.get_plugin_manager().list_plugins()}
llm = apply_llm_request_middleware({"model": "m", "messages": [], "extra_body": {"keep": 1}}, session_id="s")
tool = apply_tool_request_middleware("terminal", {"command": "ls"}, session_id="s", tool_call_id="c")
tool_calls = []
tool_result = run_tool_execution_middleware(
    "terminal", tool.payload, lambda a: tool_calls.append(a) or "tool-result", original_args=tool.original_payload,
)
provider_calls = []
response = run_llm_execution_middleware(llm.payload, lambda r: provider_calls.append(r) or {"id": "resp-1"})
annotate = sys.modules["hermes_plugins.middleware_demo_tool_annotate"]
print(json.dumps({
    "listing": {name: {"enabled": p["enabled"], "middleware": p["middleware"]} for name, p in listing.items()},
    "llm_request": llm.payload, "llm_trace": llm.trace,
    "tool_args": tool.payload, "tool_trace": tool.trace,
    "tool_result": tool_result, "tool_calls": tool_calls,
    "response": response, "provider_calls": provider_calls,
    "annotate_calls": dict(annotate.CALLS),
}))
"""


def test_interop_our_example_plugins_run_in_the_real_hermes_plugin_machinery(
    hermes_python: Path, home: Path
) -> None:
    for name in EXAMPLE_NAMES:
        install_example(home, name)
        enable_plugin(home, name)  # our writer; Hermes must read it
    out = run_in_hermes(hermes_python, home, HERMES_RUN_EXAMPLES)

    for name in EXAMPLE_NAMES:
        assert out["listing"][name] == {"enabled": True, "middleware": 1}, out["listing"].get(name)
    tagged = {"keep": 1, "metadata": {"hermes_middleware_demo": True}}
    assert out["llm_request"]["extra_body"] == tagged
    assert out["llm_trace"] == [{"source": "middleware-demo", "reason": "tagged provider request"}]
    workdir = str(Path.home() / ".hermes" / "cache" / "scratch" / "hermes-middleware-demo")
    assert out["tool_args"] == {"command": "ls", "workdir": workdir}
    assert out["tool_calls"] == [out["tool_args"]] and out["tool_result"] == "tool-result"
    assert out["annotate_calls"] == {"terminal": 1}
    assert out["response"] == {"id": "resp-1"} and out["provider_calls"] == [out["llm_request"]]

    # The same plugins in our runtime give the same effective payloads and the same trace entries.
    manager = PluginManager(home)
    manager.load()
    rt = manager.runtime
    ours_llm, ours_llm_trace = rt.apply_llm_request(
        {"session_id": "s"}, {"model": "m", "messages": [], "extra_body": {"keep": 1}}
    )
    ours_args, ours_tool_trace = rt.apply_tool_request({"session_id": "s"}, "terminal", {"command": "ls"})
    assert ours_llm == out["llm_request"] and ours_args == out["tool_args"]
    assert ours_llm_trace == out["llm_trace"] and ours_tool_trace == out["tool_trace"]


def test_interop_config_yaml_is_shared_with_hermes_plugins_enable(hermes_python: Path, home: Path) -> None:
    install_example(home, "middleware-demo-llm-tag")
    install_example(home, "middleware-demo-tool-annotate")
    script = """
    import json
    from hermes_cli.plugins_cmd import cmd_enable
    cmd_enable("middleware-demo-llm-tag", allow_tool_override=False)
    print(json.dumps({}))
    """
    run_in_hermes(hermes_python, home, script)  # `hermes plugins enable middleware-demo-llm-tag`
    states = {i.name: i.enabled for i in list_plugins(home)}
    assert states == {"middleware-demo-llm-tag": True, "middleware-demo-tool-annotate": False}

    enable_plugin(home, "middleware-demo-tool-annotate")
    disable_plugin(home, "middleware-demo-llm-tag")
    read_back = """
    import json
    from hermes_cli.plugins_cmd import _get_enabled_set, _get_disabled_set
    from hermes_cli.config import load_config
    print(json.dumps({"enabled": sorted(_get_enabled_set()), "disabled": sorted(_get_disabled_set()),
                      "entries": load_config()["plugins"].get("entries")}))
    """
    out = run_in_hermes(hermes_python, home, read_back)
    assert out["enabled"] == ["middleware-demo-tool-annotate"]
    assert out["disabled"] == ["middleware-demo-llm-tag"]
    # Hermes' own key (written by cmd_enable) survived our edit.
    assert out["entries"] == {"middleware-demo-llm-tag": {"allow_tool_override": False}}


HERMES_RUN_HERMES_STYLE = """
import json, sys
from hermes_cli import plugins
from hermes_cli.middleware import apply_tool_request_middleware, run_tool_execution_middleware

plugins.discover_plugins(force=True)
req = apply_tool_request_middleware("terminal", {"command": "ls", "token": "abc"}, session_id="s")
allowed = plugins.resolve_pre_tool_block("terminal", req.payload, middleware_trace=req.trace)
block = plugins.resolve_pre_tool_block("terminal", {"command": "rm -rf /"}, middleware_trace=req.trace)
result = run_tool_execution_middleware("terminal", req.payload, lambda a: "ran " + a["command"])
[transformed] = plugins.invoke_hook("transform_tool_result", tool_name="terminal", args=req.payload, result=result)
print(json.dumps({"args": req.payload, "block": block, "allowed": allowed, "result": transformed,
                  "seen": sys.modules["hermes_plugins.hermes_style"].SEEN}))
"""


def test_interop_hermes_style_plugin_runs_unchanged_in_our_runtime(hermes_python: Path, home: Path) -> None:
    write_plugin(home, "hermes-style", HERMES_STYLE_PLUGIN, {"name": "hermes-style", "version": "1.0"})
    enable_plugin(home, "hermes-style")
    hermes = run_in_hermes(hermes_python, home, HERMES_RUN_HERMES_STYLE)
    assert hermes["block"] == "rm is not allowed" and hermes["allowed"] is None

    manager = PluginManager(home)
    [info] = manager.load()
    assert info.enabled and info.middleware == ("tool_request", "tool_execution")
    flow = ToolCallFlow(manager)
    ours = flow.run(
        "terminal",
        {"command": "ls", "token": "abc"},
        execute=lambda a: "ran " + a["command"],
        context={"session_id": "s"},
    )
    assert ours == hermes["result"] == "RAN LS | FOOTER"
    seen = sys.modules["hermes_plugins.hermes_style"].SEEN
    # Same callbacks, same fields, same trace for the `ls` call (tool_request, then pre_tool_call).
    assert [list(x) for x in seen] == hermes["seen"][:2]
    assert seen[1] == ("pre_tool_call", ["hermes-style"])
    assert flow.run("terminal", {"command": "rm -rf /"}, execute=lambda a: "ran") == {
        "error": hermes["block"]
    }


def _hermes_bundled_plugins(hermes_python: Path, home: Path) -> Path:
    out = run_in_hermes(
        hermes_python,
        home,
        "import json, os, plugins; print(json.dumps({'dir': os.path.dirname(plugins.__file__)}))",
    )
    return Path(out["dir"])


UNSAFE_WRITE = {"path": "app.py", "content": "import pickle\ndata = pickle.load(open('x', 'rb'))\n"}


def test_interop_hermes_bundled_security_guidance_plugin_runs_unchanged_in_our_runtime(
    hermes_python: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundled = _hermes_bundled_plugins(hermes_python, home)
    assert (bundled / "security-guidance" / "plugin.yaml").exists()
    enable_plugin(home, "security-guidance", extra_dirs=[bundled])
    manager = PluginManager(home, extra_dirs=[bundled])
    infos = {i.name: i for i in manager.load()}
    assert infos["security-guidance"].enabled, infos["security-guidance"]
    assert infos["security-guidance"].hooks == ("pre_tool_call", "transform_tool_result")
    assert [i.name for i in infos.values() if i.enabled] == ["security-guidance"]  # the rest stay off

    raw = json.dumps({"bytes_written": 52})
    flow = ToolCallFlow(manager)
    ours = flow.run("write_file", dict(UNSAFE_WRITE), execute=lambda a: raw)
    assert ours.startswith(raw) and "pickle_deserialization" in ours
    hermes_script = f"""
    import json
    from hermes_cli import plugins
    plugins.discover_plugins(force=True)
    [out] = plugins.invoke_hook("transform_tool_result", tool_name="write_file", args={UNSAFE_WRITE!r}, result={raw!r})
    print(json.dumps({{"result": out}}))
    """
    assert run_in_hermes(hermes_python, home, hermes_script)["result"] == ours

    monkeypatch.setenv("SECURITY_GUIDANCE_BLOCK", "1")  # the plugin's block mode: pre_tool_call refuses
    ran: list[Any] = []
    blocked = flow.run("write_file", dict(UNSAFE_WRITE), execute=ran.append)
    assert ran == [] and blocked["error"].startswith("security-guidance refused this write")
