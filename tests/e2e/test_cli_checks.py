"""Bad settings and option values from the command line: a one-line error and a usage exit, never a
traceback; the seed's unquoted ``body_template`` in config.yaml; a taken port for ``serve``."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.placeholders import load_yaml

CLI = str(Path(sys.executable).parent / "hermes-gateway")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def _run(home: Any, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    return subprocess.run(
        [CLI, *args],
        env={**base, "HERMES_HOME": str(home.path), **env},
        capture_output=True,
        text=True,
        timeout=90,
    )


def _config(home: Any, text: str) -> None:
    (home.path / "config.yaml").write_text(text, encoding="utf-8")


SEED_TEMPLATE = """\
executors:
  http:
    allow_networks: ["127.0.0.1/32"]
    body_template: {query: {{city}}, opts: {unit: {{unit}}}}
"""


def test_the_seeds_unquoted_body_template_does_not_break_plugins_or_workers(home: Any) -> None:
    _config(home, SEED_TEMPLATE)
    listed = _run(home, "plugins", "list")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    enabled = _run(home, "plugins", "disable", "hermes-gateway")  # rewrites config.yaml
    assert enabled.returncode == 0, enabled.stderr
    rewritten = load_yaml((home.path / "config.yaml").read_text(encoding="utf-8"))
    # The template survives the rewrite: the same structure with its placeholders, as the executor reads it.
    assert rewritten["executors"]["http"]["body_template"] == {
        "query": "{{city}}",
        "opts": {"unit": "{{unit}}"},
    }
    (home.tools_dir / "hello.yaml").write_text((ROOT / "examples" / "tools" / "hello.yaml").read_text())
    ran = _run(home, "tool", "run", "hello", "{name: Alice}")  # its local worker loads plugins too
    assert ran.returncode == 0 and ran.stdout == "Hello, Alice!\n", ran.stderr


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("workers: {lease: abc}\n", "config.yaml: workers.lease: expected a number, got 'abc'"),
        ("executors: [a, b]\n", "config.yaml: executors: expected a mapping, got list"),
        ("executors: {http: 5}\n", "config.yaml: executors.http: expected a mapping, got 5"),
        ("policy: [a]\n", "config.yaml: policy: expected a mapping, got list"),
        ("logging: {level: LOUD}\n", "config.yaml: logging.level: expected one of DEBUG, INFO"),
    ],
)
def test_a_wrong_type_in_config_yaml_is_one_line_naming_the_setting(
    home: Any, config: str, says: str
) -> None:
    _config(home, config)
    out = _run(home, "tool", "list")
    assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(("value", "shown"), [("lots", "'lots'"), ("0", "0")])
def test_a_bad_executor_concurrency_is_refused_with_its_path(home: Any, value: str, shown: str) -> None:
    _config(home, f"executors: {{command: {{concurrency: {value}}}}}\n")  # (0 would leave every call waiting)
    (home.tools_dir / "hello.yaml").write_text((ROOT / "examples" / "tools" / "hello.yaml").read_text())
    out = _run(home, "tool", "run", "hello", "{name: A}")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"executors.command.concurrency: expected an integer of at least 1, got {shown}" in out.stderr


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["chat", "-q", "hi", "--max-turns", "0"], "--max-turns"),
        (["serve", "--port", "99999"], "--port"),
        (["flow", "run", "x.yaml", "--wait", "-1"], "--wait"),
        (["--log-level", "LOUD", "tool", "list"], "--log-level"),
        (["worker", "--queues", ","], "--queues"),
        (["worker", "--concurrency", "0"], "--concurrency"),
        (["chat", "-q", "hi", "--timeout", "0"], "--timeout"),
        (["status", "--watch", "--json", "--interval", "-1"], "--interval"),  # (0: a loop hammering the broker)
        (["status", "--watch", "--interval", "0"], "--interval"),
        (["stop", "--all", "--grace", "-1"], "--grace"),
        (["batch", "wait", "0123456789abcdef0123", "--timeout", "-1"], "--timeout"),
    ],
)
def test_bad_option_values_are_usage_errors(home: Any, redis_url: str, args: list[str], option: str) -> None:
    out = _run(home, *args, HERMES_REDIS_URL=redis_url)  # (a broker for a command that would start anyway)
    assert out.returncode == 2 and f"Invalid value for '{option}'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_serve_on_a_taken_port_says_so_before_starting_anything(home: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = _run(home, "serve", "--port", str(port))
    assert out.returncode == 2, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
    assert "stop --all" in out.stderr and "broker:" not in out.stderr and "console and API" not in out.stderr
    # stop --all finds the processes of one HERMES_HOME: the message names the one it looked in.
    assert f"no gateway process of HERMES_HOME {home.path} holds it (looked in {home.path / 'run'})" in out.stderr
    assert "--home THAT_HOME stop --all" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_console_spans_go_to_stderr_so_stdout_is_the_result(home: Any) -> None:
    (home.tools_dir / "hello.yaml").write_text((ROOT / "examples" / "tools" / "hello.yaml").read_text())
    out = _run(home, "--trace", "console", "tool", "run", "hello", "{name: Alice}")
    assert out.returncode == 0 and out.stdout == "Hello, Alice!\n", (out.stdout, out.stderr)
    assert '"trace_id": "0x' in out.stderr  # the SDK's console exporter's JSON


ECHO_SPEC = "name: echo\nexecutor: python\nfunction: workers.executors.builtin:echo\n"
FLOW = """\
name: greet
steps:
  - id: say
    tool: echo
    args: {who: "{{ args.who }}"}
result: "{{ steps.say.result.who }}"
"""


def test_the_flow_file_in_the_docs_runs_as_printed(home: Any, tmp_path: Path) -> None:
    import re

    text = (ROOT / "docs" / "flow-control.md").read_text(encoding="utf-8")  # the flow file the docs show
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.startswith("# greet.yaml"))
    (home.tools_dir / "hello.yaml").write_text((ROOT / "examples" / "tools" / "hello.yaml").read_text())
    (tmp_path / "greet.yaml").write_text(block)
    command = block.splitlines()[0].split(": ", 1)[1]  # the command its first comment line gives
    argv = shlex.split(command)
    assert argv[:3] == ["hermes-gateway", "flow", "run"]
    out = subprocess.run([CLI, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=90,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("HERMES_")},
                              "HERMES_HOME": str(home.path)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"first": "Hello, Ada!", "others": ["Hello, Bob!", "Hello, Carol!"]}


def test_flow_args_take_the_yaml_form_a_file_or_stdin_and_a_failed_flow_prints_no_result(
    home: Any, tmp_path: Path
) -> None:
    (home.tools_dir / "echo.yaml").write_text(ECHO_SPEC)
    flow = tmp_path / "flow.yaml"
    flow.write_text(FLOW)
    yaml_form = _run(home, "flow", "run", str(flow), "--args", "{who: Alice}")
    assert yaml_form.returncode == 0 and yaml_form.stdout == "Alice\n", yaml_form.stderr
    args_file = tmp_path / "args.json"
    args_file.write_text('{"who": "Bob"}')
    from_file = _run(home, "flow", "run", str(flow), "--args", f"@{args_file}")
    assert from_file.returncode == 0 and from_file.stdout == "Bob\n", from_file.stderr
    base = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    from_stdin = subprocess.run(
        [CLI, "flow", "run", str(flow), "--args", "-"], input="{who: Cy}", capture_output=True, text=True,
        env={**base, "HERMES_HOME": str(home.path)}, timeout=90,
    )  # fmt: skip
    assert from_stdin.returncode == 0 and from_stdin.stdout == "Cy\n", from_stdin.stderr
    (home.tools_dir / "echo.yaml").write_text(ECHO_SPEC + "input_schema: {properties: {who: {type: integer}}}\n")
    failed = _run(home, "flow", "run", str(flow), "--args", "{who: Dee}")  # (the call is refused: the flow fails)
    assert failed.returncode == 1 and failed.stdout == "" and "step say: invalid_args" in failed.stderr, failed
    (home.tools_dir / "echo.yaml").unlink()  # the step's tool is gone: the flow is refused before any call
    refused = _run(home, "flow", "run", str(flow), "--args", "{who: Dee}")
    assert refused.returncode == 2 and "step say: unknown tool 'echo'" in refused.stderr, refused
    missing = _run(home, "flow", "run", str(flow), "--args", "@/nonexistent/args.json")
    assert missing.returncode == 2 and "cannot read arguments from /nonexistent/args.json" in missing.stderr


def test_tool_run_reads_its_arguments_from_stdin_or_a_file(home: Any, tmp_path: Path) -> None:
    (home.tools_dir / "hello.yaml").write_text((ROOT / "examples" / "tools" / "hello.yaml").read_text())
    base = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env = {**base, "HERMES_HOME": str(home.path)}
    piped = subprocess.run(
        [CLI, "tool", "run", "hello", "-"], input='{"name": "Stdin"}', env=env, capture_output=True, text=True,
        timeout=90,
    )  # fmt: skip
    assert piped.returncode == 0 and piped.stdout == "Hello, Stdin!\n", piped.stderr
    args = tmp_path / "args.yaml"
    args.write_text("{name: File}")
    from_file = _run(home, "tool", "run", "hello", f"@{args}")
    assert from_file.returncode == 0 and from_file.stdout == "Hello, File!\n", from_file.stderr
    zero = _run(home, "tool", "run", "hello", "--timeout", "0")
    assert zero.returncode == 2 and "Invalid value for '--timeout'" in zero.stderr


def test_tool_run_timeout_is_the_calls_and_the_command_reports_its_tool_timeout(home: Any) -> None:
    home.sleep_tool()  # (its spec's timeout: 30 s)
    # The call is stopped at its worker after 1 s; the command waits for that end (it gave up just before it,
    # with "no result ... within 1s", a wait of its own that said nothing of the call).
    ran = _run(home, "tool", "run", "sleep", "{seconds: 5}", "--timeout", "1")
    assert ran.returncode == 1 and "error: tool_timeout: tool 'sleep' timed out after 1s" in ran.stderr, ran.stderr


def test_a_pools_json_logs_are_one_object_per_line(home: Any, redis_url: str, tmp_path: Path) -> None:
    # The processes of a pool share one stderr (a pipe under docker or systemd): a line written as two
    # write()s came out glued to another process's line.
    import json
    import threading
    import time

    from hermes_gateway import Gateway

    (home.tools_dir / "echo.yaml").write_text(ECHO_SPEC)
    base = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env = {**base, "HERMES_HOME": str(home.path), "HERMES_REDIS_URL": redis_url}
    pool = subprocess.Popen(
        [CLI, "--log-format", "json", "--log-level", "DEBUG", "worker", "--queues", "tools", "-c", "16", "-p", "2"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    chunks: list[bytes] = []
    assert pool.stderr is not None
    reader = threading.Thread(
        target=lambda: chunks.extend(iter(lambda: pool.stderr.read(65536), b"")), daemon=True
    )
    reader.start()  # drained as it comes: a full pipe would stop the workers
    try:
        gw = Gateway.connect(redis_url)
        gw.sync_tools(home.tools_dir)
        deadline = time.monotonic() + 30
        while len(gw.live_workers("tools")) < 2:
            assert time.monotonic() < deadline and pool.poll() is None, "the pool did not start"
            time.sleep(0.05)
        for _ in range(2):
            for h in gw.map("echo", [{"i": i} for i in range(300)]):
                h.result(30)
        gw.close()
    finally:
        pool.terminate()
        pool.wait(60)
        reader.join(10)
    lines = b"".join(chunks).decode().splitlines()
    assert len(lines) > 600  # DEBUG: several lines a call
    bad = [line for line in lines if not line.startswith("{") or not isinstance(json.loads(line), dict)]
    assert bad == [], bad[:3]


def test_stop_with_a_name_no_worker_has_is_an_error_and_a_real_name_is_stopped(
    home: Any, redis_url: str, workers: Any
) -> None:
    [worker] = workers(1)
    env = {"HERMES_REDIS_URL": redis_url}
    typo = _run(home, "stop", "hermes-typo-name", **env)
    assert (
        typo.returncode == 1
        and "no such worker: hermes-typo-name" in typo.stderr
        and worker.name in typo.stderr
    )
    assert worker.alive
    real = _run(home, "stop", worker.name, **env)
    assert real.returncode == 0 and f"stop sent to {worker.name}" in real.stdout
    assert worker.wait(30) == 0
