"""The seed's four example plugins enabled in HERMES_HOME, against real worker processes.

``middleware-demo-llm-tag`` (llm_request), ``middleware-demo-terminal-workdir`` (tool_request),
``middleware-demo-llm-timing`` (llm_execution) and ``middleware-demo-tool-annotate`` (tool_execution),
copied into ``$HERMES_HOME/plugins`` and enabled as a user would; plus ``hermes-gateway plugins reload``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.errors import CallFailed, PermissionDenied
from middleware import enable_plugin
from tests.conftest import ECHO, Home, wait_until
from tests.llm_server import LLMServer

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "plugins"
LLM_TAG = "middleware-demo-llm-tag"
WORKDIR = "middleware-demo-terminal-workdir"
TIMING = "middleware-demo-llm-timing"
ANNOTATE = "middleware-demo-tool-annotate"
ALL = (LLM_TAG, WORKDIR, TIMING, ANNOTATE)
KEY = f"sk-e2e-{uuid.uuid4().hex}"
TAG = {"hermes_middleware_demo": True}
ASK = {"messages": [{"role": "user", "content": "Reply exactly ok"}], "stream": True}


@pytest.fixture
def llm() -> Iterator[LLMServer]:
    with LLMServer(api_key=KEY) as server:
        yield server


@pytest.fixture
def user_home(tmp_path: Path) -> Path:
    """The workers' $HOME: the workdir plugin's default lives under it."""
    path = tmp_path / "user-home"
    path.mkdir()
    return path


def demo_dir(user_home: Path) -> str:
    """Where ``middleware-demo-terminal-workdir`` points terminal calls by default."""
    return str(user_home / ".hermes" / "cache" / "scratch" / "hermes-middleware-demo")


def set_up(home: Home, llm: LLMServer, allow: list[str], enabled: tuple[str, ...]) -> None:
    """config.yaml (model + a workdir policy), the ``terminal`` tool, and the example plugins."""
    home.config(
        {
            "model": {
                "provider": "openai-compatible",
                "base_url": llm.base_url,
                "api_key": "${E2E_KEY}",
                "model": "hermes-test",
            },
            "policy": {"args": {"path_prefixes": {"terminal": {"args": ["workdir"], "allow": allow}}}},
        }
    )
    home.tool(
        "terminal",
        function=ECHO,
        timeout=10,
        input_schema={
            "type": "object",
            "properties": {"command": {"type": "string"}, "workdir": {"type": "string"}},
            "required": ["command", "workdir"],
            "additionalProperties": False,
        },
    )
    for name in ALL:
        shutil.copytree(EXAMPLES / name, home.path / "plugins" / name)
    for name in enabled:
        enable_plugin(home.path, name)


def start(workers: Any, user_home: Path) -> Any:
    [worker] = workers(queues="llm,tools", env={"HOME": str(user_home), "E2E_KEY": KEY})
    return worker


def reload_plugins(redis_url: str, home: Home, *command: str) -> str:
    """``hermes-gateway plugins reload`` (or ``command``, e.g. ``disable NAME``), as a user runs it."""
    env = {**os.environ, "HERMES_REDIS_URL": redis_url, "HERMES_HOME": str(home.path)}
    out = subprocess.run(
        [str(Path(sys.executable).parent / "hermes-gateway"), "plugins", *(command or ("reload",))],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return out.stdout


def test_the_four_example_plugins_on_real_workers(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, user_home: Path
) -> None:
    demo = demo_dir(user_home)
    set_up(home, llm, allow=[demo], enabled=ALL)
    gateway.sync_tools()
    worker = start(workers, user_home)
    loaded = next(line for line in worker.log().splitlines() if "plugins loaded" in line)
    assert all(name in loaded for name in ALL)

    # llm-tag: the tag is in the request the provider received.
    reply = gateway.call_llm(ASK).result(20)
    assert reply["choices"][0]["message"]["content"] == "ok"
    assert llm.chat_requests[-1].body["metadata"] == TAG
    # llm-timing: the wrapper logged the provider call's elapsed time in the worker's output.
    wait_until(lambda: "llm_execution elapsed_ms=" in worker.log(), timeout=5, message="the timing line")

    # terminal-workdir: no workdir given, the middleware's default passes the schema (workdir is
    # required) and the path policy (only the demo dir is allowed): both judged the rewritten args.
    # tool-annotate wraps the execution and hands back the tool's result unchanged.
    assert gateway.call_tool("terminal", {"command": "ls"}).result(20) == {"command": "ls", "workdir": demo}
    # An explicit workdir is kept (setdefault) and the policy refuses it.
    with pytest.raises(PermissionDenied) as info:
        gateway.call_tool("terminal", {"command": "ls", "workdir": "/etc"}).result(20)
    assert info.value.type == "permission_denied" and "'/etc'" in str(info.value)
    assert info.value.details["rule"] == "args.path_prefixes.terminal"
    assert KEY not in worker.log()


def test_the_policy_judges_the_workdir_the_middleware_wrote(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, user_home: Path, tmp_path: Path
) -> None:
    # The policy allows somewhere else: the caller sent no workdir at all, so the only value the
    # policy can refuse is the one the tool_request middleware put there.
    set_up(home, llm, allow=[str(tmp_path / "elsewhere")], enabled=(WORKDIR,))
    gateway.sync_tools()
    start(workers, user_home)
    with pytest.raises(PermissionDenied) as info:
        gateway.call_tool("terminal", {"command": "ls"}).result(20)
    assert repr(demo_dir(user_home)) in str(info.value)


def test_plugins_reload_makes_a_running_worker_pick_up_newly_enabled_plugins(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, user_home: Path, redis_url: str
) -> None:
    demo = demo_dir(user_home)
    set_up(home, llm, allow=[demo], enabled=())
    gateway.sync_tools()
    worker = start(workers, user_home)
    gateway.call_llm(ASK).result(20)
    assert "metadata" not in llm.chat_requests[-1].body
    with pytest.raises(CallFailed) as info:  # no middleware: the required workdir is missing
        gateway.call_tool("terminal", {"command": "ls"}).result(20)
    assert info.value.type == "invalid_args"

    enable_plugin(home.path, LLM_TAG)
    enable_plugin(home.path, WORKDIR)
    assert "reload sent to workers" in reload_plugins(redis_url, home)
    wait_until(lambda: worker.log().count("plugins loaded") >= 2, timeout=10, message="the worker to reload")

    gateway.call_llm(ASK).result(20)
    assert llm.chat_requests[-1].body["metadata"] == TAG
    assert gateway.call_tool("terminal", {"command": "ls"}).result(20) == {"command": "ls", "workdir": demo}
    assert worker.alive and len(workers.started) == 1  # the same process, never restarted

    # Disabling one stops its middleware in the running worker too: the command tells the workers to reload.
    assert "reload sent to the workers" in reload_plugins(redis_url, home, "disable", LLM_TAG)
    wait_until(lambda: worker.log().count("plugins loaded") >= 3, timeout=10, message="the worker to reload")
    gateway.call_llm(ASK).result(20)
    assert "metadata" not in llm.chat_requests[-1].body


def test_plugins_the_caller_already_ran_are_not_run_again_on_the_worker(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, user_home: Path
) -> None:
    # A Hermes agent sharing this HERMES_HOME runs these plugins around its calls itself and says so
    # (context plugins_applied); the worker then skips them for that call, so each runs once.
    demo = demo_dir(user_home)
    set_up(home, llm, allow=[demo], enabled=(LLM_TAG, WORKDIR))
    gateway.sync_tools()
    start(workers, user_home)
    # Not applied by the caller: the worker's tool_request middleware fills in the workdir.
    assert gateway.call_tool("terminal", {"command": "ls"}).result(20)["workdir"] == demo
    # Applied by the caller: skipped here, so nothing fills the required workdir in.
    with pytest.raises(CallFailed) as info:
        gateway.call_tool("terminal", {"command": "ls"}, plugins_applied=f"{LLM_TAG},{WORKDIR}").result(20)
    assert info.value.type == "invalid_args" and "workdir" in str(info.value)
    # The same for LLM calls: the caller's llm_request tag is not added a second time.
    gateway.call_llm(ASK, plugins_applied=LLM_TAG).result(20)
    assert "metadata" not in llm.chat_requests[-1].body
    gateway.call_llm(ASK).result(20)
    assert llm.chat_requests[-1].body["metadata"] == TAG


STATE_PLUGIN = '''
import json, os, time


def _note(what):
    with open(os.environ["E2E_STATE_LOG"], "a") as f:
        f.write(json.dumps({"what": what, "at": time.time()}) + "\\n")


def _wrap(**kw):
    _note("tool_execution")
    time.sleep(0.3)
    result = kw["next_call"](kw["args"])
    _note("tool_execution returned")
    return result


def _post(**kw):
    _note("post_tool_call")


def register(ctx):
    ctx.register_middleware("tool_execution", _wrap)
    ctx.register_hook("post_tool_call", _post)
'''


def test_the_call_is_executing_around_the_tool_execution_chain_and_formatting_for_post_tool_call(
    home: Home, gateway: Any, workers: Any, tmp_path: Path
) -> None:
    """DESIGN.md's flow: `executing`: the tool_execution chain around the executor; `formatting`:
    post_tool_call hooks. The moves' times (each event's ts) bracket what the plugin saw when."""
    from broker import events

    root = home.path / "plugins" / "state-noter"
    root.mkdir(parents=True)
    (root / "plugin.yaml").write_text("name: state-noter\nversion: '0.1.0'\nkind: standalone\n")
    (root / "__init__.py").write_text(STATE_PLUGIN)
    enable_plugin(home.path, "state-noter")
    home.echo_tool()
    gateway.sync_tools()
    log = tmp_path / "states.jsonl"
    workers(1, env={"E2E_STATE_LOG": str(log)})
    handle = gateway.call_tool("echo", {"text": "hi"})
    assert handle.result(20) == {"text": "hi"}
    at = {json.loads(line)["what"]: json.loads(line)["at"] for line in log.read_text().splitlines()}
    moves = {e.state: e.ts for e in handle.events(timeout=5) if e.type == events.TRANSITION}
    assert moves["executing"] <= at["tool_execution"]  # executing before the chain starts
    assert at["tool_execution returned"] <= moves["formatting"] <= at["post_tool_call"]


def own_plugin(home: Home, name: str, code: str) -> None:
    """A plugin of this test's own (``code`` its ``__init__.py``) in ``$HERMES_HOME/plugins``, enabled."""
    plugin = home.path / "plugins" / name
    plugin.mkdir()
    (plugin / "plugin.yaml").write_text(f"name: {name}\nversion: '0.1.0'\nkind: standalone\n")
    (plugin / "__init__.py").write_text(code)
    enable_plugin(home.path, name)


SDK_ANSWER = '''"""llm_execution that answers with the provider SDK's own object, as Hermes' adapters return one."""
from openai.types.chat import ChatCompletion


def register(ctx):
    ctx.register_middleware("llm_execution", answer)


def answer(**kwargs):
    return ChatCompletion.model_validate({
        "id": "cached-1", "object": "chat.completion", "created": 1, "model": "cache",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "from cache"}}],
    })
'''


READS_ATTRIBUTES = '''"""llm_execution that reads the response as Hermes' adapters hand it: attributes, as the SDK's object."""


def register(ctx):
    ctx.register_middleware("llm_execution", shout)


def shout(**kwargs):
    response = kwargs["next_call"](kwargs["request"])
    message = response.choices[0].message
    assert message.tool_calls is None  # (a field the response lacks reads as None, as the SDK's)
    message["content"] = message.content.upper() + " / " + response["choices"][0]["finish_reason"]
    return response
'''


def test_an_llm_execution_middleware_reads_the_response_by_attribute_or_by_key(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, user_home: Path
) -> None:
    set_up(home, llm, allow=[], enabled=())
    own_plugin(home, "reads-attributes", READS_ATTRIBUTES)
    start(workers, user_home)
    reply = gateway.call_llm({"messages": [{"role": "user", "content": "Reply exactly ok"}]}).result(20)
    assert reply["choices"][0]["message"]["content"] == "OK / stop"


def test_an_llm_execution_middleware_may_answer_with_the_sdks_own_response_object(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, user_home: Path
) -> None:
    set_up(home, llm, allow=[], enabled=())
    own_plugin(home, "sdk-answer", SDK_ANSWER)
    start(workers, user_home)
    reply = gateway.call_llm({"messages": [{"role": "user", "content": "hi"}]}).result(20)
    assert reply["id"] == "cached-1" and reply["choices"][0]["message"]["content"] == "from cache"
    assert llm.chat_requests == []  # (short-circuited: the provider was not called)
