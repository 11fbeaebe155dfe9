"""The command line as a newcomer meets it: the seed's `tool run` on a fresh machine (embedded broker),
the no-worker message, `tool list`, `status` and `demo` — each run as a real subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import sigint_as_by_default

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).parent / "hermes-gateway")

pytestmark = pytest.mark.e2e


def _run(args: list[str], env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _env(home: Any, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env["HERMES_HOME"] = str(home.path)
    env.update(extra)
    return env


def test_the_seeds_hello_runs_on_the_embedded_broker_without_any_redis_url(home: Any) -> None:
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    env = _env(home)

    plain = _run(["tool", "run", "hello", '{"name": "Alice"}'], env)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == "Hello, Alice!\n"
    assert "embedded broker" in plain.stderr

    followed = _run(["tool", "run", "hello", "{name: Alice}", "--follow"], env)
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout == "Hello, Alice!\n"
    lines = [ln for ln in followed.stderr.splitlines() if ln.startswith("[")]
    assert [ln.split()[2] for ln in lines] == ["pending", "routing", "executing", "formatting", "done"]
    trace_ids = {ln.split("trace_id=")[1].split()[0] for ln in lines}
    assert len(trace_ids) == 1 and len(trace_ids.pop()) == 32


def test_unquoted_args_as_the_shell_splits_them_and_a_bad_spec_file_spoils_only_itself(
    redis_url: str, home: Any, workers: Any
) -> None:
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    (home.tools_dir / "ftp.yaml").write_text("name: fetch\nexecutor: ftp\n")
    workers(1)
    env = _env(home, HERMES_REDIS_URL=redis_url)

    # The seed's `hermes tool run hello {name: Alice}` typed without quotes: the shell gives two words.
    ran = _run(["tool", "run", "hello", "{name:", "Alice}"], env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "Hello, Alice!\n"
    assert "ftp.yaml" in ran.stderr and "tool executor not found: 'ftp'" in ran.stderr

    listed = _run(["tool", "list", "--json"], env)
    assert listed.returncode == 0, listed.stderr
    names = {t["name"] for t in json.loads(listed.stdout)}
    assert "hello" in names and "fetch" not in names
    assert "warning: skipped" in listed.stderr and "ftp.yaml" in listed.stderr


def test_a_bad_policy_in_config_is_a_clear_error_at_once_not_a_worker_that_never_starts(home: Any) -> None:
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    (home.path / "config.yaml").write_text("policy:\n  mode: greylist\n")
    started = time.monotonic()
    out = _run(["tool", "run", "hello", "{name: Alice}"], _env(home), timeout=30)
    assert out.returncode == 2
    assert "policy.mode: expected one of" in out.stderr and "greylist" in out.stderr
    assert time.monotonic() - started < 10
    # ... and it blocks only what starts workers: the typo does not stop you from stopping things.
    stopped = _run(["stop", "--all"], _env(home), timeout=30)
    assert stopped.returncode == 0 and "nothing running" in stopped.stdout, stopped.stderr


def test_debug_and_log_format_json_give_only_json_lines_on_stderr_for_jq(home: Any) -> None:
    # The seed's tip: `logging.level: DEBUG` in config.yaml plus `--log-format json`, filtered with jq. The
    # flag may follow the command, and the command's notices and its local worker's lines are JSON too.
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    (home.path / "config.yaml").write_text("logging:\n  level: DEBUG\n")
    out = _run(["tool", "run", "hello", "{name: Alice}", "--log-format", "json"], _env(home))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Hello, Alice!\n"
    lines = [json.loads(line) for line in out.stderr.splitlines()]  # every line parses
    events = {line["event"] for line in lines}
    assert any(e.startswith("broker: embedded broker") for e in events)
    finished = [line for line in lines if line["event"] == "call finished"]
    assert len(finished) == 1 and finished[0]["state"] == "done" and len(finished[0]["trace_id"]) == 32
    assert {line["level"] for line in lines} >= {"info", "debug"}

    refused = _run(["--log-format=json", "tool", "run", "nope"], _env(home))
    assert refused.returncode == 2
    [error] = [json.loads(line) for line in refused.stderr.splitlines() if '"error"' in line]
    assert error["level"] == "error" and "nope" in error["event"]


def test_an_explicit_log_level_reaches_the_private_worker_of_tool_run(home: Any) -> None:
    # README: in JSON mode the lines of the workers a command starts are JSON lines too; at
    # `--log-level info` its private worker's `call finished` line is among them, with the call's ids.
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    args = ["--log-format", "json", "--log-level", "info", "tool", "run", "hello", '{"name": "Alice"}', "--follow"]
    out = _run(args, _env(home))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Hello, Alice!\n"
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    follow = [line["event"] for line in lines if line["event"].startswith("[")]
    trace_id = follow[0].split("trace_id=")[1].split()[0]
    finished = [line for line in lines if line["event"] == "call finished"]
    assert len(finished) == 1, lines
    assert finished[0]["state"] == "done" and finished[0]["trace_id"] == trace_id
    assert re.fullmatch(r"\{tools\}\.[0-9a-f]{32}", finished[0]["call_id"]), finished
    # With the default level the command stays quiet: its worker's INFO lines are not shown.
    quiet = _run(["--log-format", "json", "tool", "run", "hello", '{"name": "Alice"}'], _env(home))
    assert quiet.returncode == 0, quiet.stderr
    assert "call finished" not in quiet.stderr


def test_a_middleware_failing_open_is_one_warning_on_the_commands_stderr(home: Any) -> None:
    # The middleware seed's local test: enable a plugin in HERMES_HOME and run a call there. A callback
    # with the wrong signature fails open, and the one WARNING naming the fields it is given shows at the
    # default level (a command's own worker logged errors only: the broken plugin looked fine).
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    plugin = home.path / "plugins" / "mwbad"
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text('name: mwbad\nversion: "0.1.0"\nkind: standalone\n')
    (plugin / "__init__.py").write_text(
        "def register(ctx):\n    ctx.register_middleware('tool_request', bad)\n\n"
        "def bad(args, tool_name, not_a_field):\n    return None\n"
    )
    env = _env(home)
    assert _run(["plugins", "enable", "mwbad"], env).returncode == 0
    out = _run(["tool", "run", "hello", '{"name": "Alice"}'], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Hello, Alice!\n"  # (fail-open: the call ran as if the middleware were not there)
    warned = [line for line in out.stderr.splitlines() if "tool_request callback hermes_plugins.mwbad.bad raised" in line]
    assert len(warned) == 1 and "warning" in warned[0] and "it is given: " in warned[0], out.stderr
    assert "call finished" not in out.stderr  # (INFO lines stay out)


def test_in_json_mode_the_commands_own_output_is_json_whatever_the_level(home: Any) -> None:
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    out = _run(["tool", "run", "hello", "{name: Alice}", "--follow", "--log-format", "json", "--log-level", "ERROR"], _env(home))
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert [line["event"].split()[2] for line in lines if line["event"].startswith("[")] == [
        "pending", "routing", "executing", "formatting", "done"
    ]
    failed = _run(["--log-level", "CRITICAL", "--log-format", "json", "tool", "run", "nope"], _env(home))
    assert failed.returncode == 2
    [error] = [line for line in map(json.loads, failed.stderr.splitlines()) if line["level"] == "error"]
    assert "nope" in error["event"]


def test_a_global_options_value_that_is_a_command_name_is_not_taken_for_the_command(home: Any, tmp_path: Path) -> None:
    demo_home = tmp_path / "demo"  # `--home demo`: the value is also the name of a command
    (demo_home / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", demo_home / "tools" / "hello.yaml")
    env = _env(home)
    out = subprocess.run(
        [CLI, "--home", "demo", "tool", "run", "hello", "{name: Bob}", "--log-level", "WARNING"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=90,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Hello, Bob!\n"


def test_tool_run_says_at_once_when_no_worker_listens(redis_url: str, home: Any) -> None:
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    started = time.monotonic()
    out = _run(["tool", "run", "hello", '{"name": "Alice"}'], _env(home, HERMES_REDIS_URL=redis_url), timeout=30)
    assert out.returncode == 2
    assert "no worker listens on queue 'tools'" in out.stderr
    assert "hermes-gateway worker --queues tools" in out.stderr
    assert time.monotonic() - started < 20  # it does not wait for a result that cannot come


def test_a_failing_call_exits_1_with_its_typed_error(redis_url: str, home: Any, workers: Any) -> None:
    home.tool("boom", executor="command", command="false", timeout=5)
    workers(1)
    out = _run(["tool", "run", "boom"], _env(home, HERMES_REDIS_URL=redis_url), timeout=30)
    assert out.returncode == 1
    assert "executor_error" in out.stderr


def test_ctrl_c_on_tool_run_cancels_its_call_and_says_so(
    redis_url: str, home: Any, gateway: Any, workers: Any, wait_until: Any
) -> None:
    import signal

    from broker import events

    home.sleep_tool("nap")
    workers(1)
    run = subprocess.Popen([CLI, "tool", "run", "nap", "{seconds: 30}"], env=_env(home, HERMES_REDIS_URL=redis_url),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=sigint_as_by_default)  # fmt: skip
    try:
        wait_until(lambda: _executing(gateway.conn), 20, message="a worker to take the call")
        run.send_signal(signal.SIGINT)  # Ctrl-C while it waits for the result
        _out, err = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err
    found = re.search(r"interrupted: call (\S+) cancelled", err)
    assert found is not None, err
    ended = wait_until(lambda: [e for e in events.history(gateway.conn, found[1]) if e.terminal], 10, message="its end")
    assert ended[-1].state == "cancelled"


def test_ctrl_c_while_tool_run_is_still_submitting_cancels_the_call_it_sent(
    redis_url: str, home: Any, gateway: Any, workers: Any, wait_until: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    import structlog
    from click.testing import CliRunner

    from broker import events
    from hermes_gateway.cli import main
    from hermes_gateway.client import Gateway

    home.sleep_tool("nap")
    workers(1)
    send = Gateway._send_chunk

    def interrupted(self: Any, chunk: Any) -> Any:
        replies = send(self, chunk)  # the SUBMIT went out; Ctrl-C lands before call_tool returns
        wait_until(lambda: _executing(gateway.conn), 20, message="a worker to take the call")
        os.kill(os.getpid(), signal.SIGINT)
        return replies

    monkeypatch.setattr(Gateway, "_send_chunk", interrupted)
    try:
        out = CliRunner().invoke(main, ["tool", "run", "nap", "{seconds: 30}"],
                                 env={"HERMES_REDIS_URL": redis_url, "HERMES_HOME": str(home.path)})  # fmt: skip
    finally:
        structlog.reset_defaults()  # (the command configured logging onto the runner's stream)
    assert out.exit_code == 130, out.output
    found = re.search(r"interrupted: call (\S+) cancelled", out.output)
    assert found is not None, out.output
    ended = wait_until(lambda: [e for e in events.history(gateway.conn, found[1]) if e.terminal], 10, message="its end")
    assert ended[-1].state == "cancelled"


def _executing(conn: Any) -> bool:
    """A worker holds a call of the tools queue (its lease)."""
    from broker import keys

    return bool(conn.zcard(keys.leases(keys.tag("tools"))))


def test_tool_list_and_status_show_the_tools_workers_and_recent_failures(redis_url: str, home: Any, workers: Any) -> None:
    home.tool("boom", executor="command", command="false", timeout=5)
    home.echo_tool()
    [worker] = workers(1)
    env = _env(home, HERMES_REDIS_URL=redis_url)
    listed = json.loads(_run(["tool", "list", "--json"], env).stdout)
    assert {t["name"] for t in listed} >= {"boom", "echo"}
    assert _run(["tool", "run", "boom"], env).returncode == 1

    status = _run(["status", "--json"], env)
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert [w["name"] for w in data["workers"]] == [worker.name]
    assert any(q["queue"] == "tools" for q in data["queues"])
    assert data["recent_failures"][0]["name"] == "boom"
    assert data["recent_failures"][0]["error"]["type"] == "executor_error"

    table = _run(["status"], env)
    assert table.returncode == 0 and worker.name in table.stdout and "recent failures" in table.stdout


def test_tool_list_and_status_show_brackets_in_a_description_or_error_as_written(
    redis_url: str, home: Any, workers: Any
) -> None:
    hostile = "[/red] [link=javascript:x]y[/link]"
    home.tool("brackets", executor="command", command=["sh", "-c", f"echo '{hostile}' >&2; exit 3"], timeout=5,
              description=f"says {hostile}")
    workers(1)
    env = _env(home, HERMES_REDIS_URL=redis_url)
    assert _run(["tool", "run", "brackets"], env).returncode == 1
    listed = _run(["tool", "list"], env)  # (rich read them as markup: MarkupError, a traceback)
    assert listed.returncode == 0 and f"says {hostile}" in listed.stdout, listed.stderr
    status = _run(["status"], env)
    assert status.returncode == 0 and hostile in status.stdout, status.stderr


def test_demo_runs_a_live_batch_and_ends_with_a_summary_and_the_topology(home: Any) -> None:
    out = _run(["demo", "--calls", "60", "--processes", "1", "--concurrency", "16"], _env(home), timeout=120)
    assert out.returncode == 0, out.stderr
    for needle in ("one call, live", "seq=1 pending", "done", "summary", "throughput", "latency p50",
                   "latency p99", "topology", "embedded broker"):
        assert needle in out.stdout, needle
    assert "│ calls" in out.stdout and "60" in out.stdout
    # Its failures are on purpose, and it says so on screen (calls 7 and 57 of 60 ask for Atlantis).
    assert "2 of them ask for the weather in 'Atlantis', which fails on purpose" in out.stdout
    rows = {" ".join(line.strip("│ ").split("│")[0].split()): line for line in out.stdout.splitlines() if "│" in line}
    assert rows["failed (executor_error)"].split("│")[-2].strip() == "2", out.stdout
    assert rows["of them on purpose (city 'Atlantis')"].split("│")[-2].strip() == "2", out.stdout


def _demo_leftovers(conn: Any) -> dict[str, Any]:
    """What a demo could leave on a shared broker: calls not ended, queued ids, leases, slots held."""
    from broker import keys
    from broker.states import TERMINAL

    tag = keys.tag("demo")
    states = [conn.hget(k, "h_state") for k in conn.scan_iter(match=keys.job(tag + ".*"), count=1000)]
    return {
        "unended": sum(1 for st in states if st is not None and st.decode() not in TERMINAL),
        "queued": conn.llen(keys.queue("demo")),
        "leases": conn.zcard(keys.leases(tag)),
        "slots": sum(conn.zcard(k) for k in conn.scan_iter(match=keys.slots(tag, "*"))),
        "calls": len(states),
    }


def test_demo_on_a_shared_broker_leaves_the_users_tools_and_no_call_behind(
    redis_url: str, home: Any, gateway: Any
) -> None:
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    home.echo_tool("get_weather")
    gateway.sync_tools()
    before = {e.spec.name: (e.version, e.spec) for e in gateway.tools()}
    out = _run(["demo", "--calls", "40", "--processes", "1", "--concurrency", "8"],
               _env(home, HERMES_REDIS_URL=redis_url), timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tools: demo_hello, demo_get_weather" in out.stdout
    gateway.directory.invalidate()
    # The user's hello and get_weather are as they were; the demo's own tools are gone with its workers.
    assert {e.spec.name: (e.version, e.spec) for e in gateway.tools()} == before
    left = _demo_leftovers(gateway.conn)
    assert left["calls"] == 41 and left == {"unended": 0, "queued": 0, "leases": 0, "slots": 0, "calls": 41}


def test_demo_interrupted_mid_batch_cancels_its_calls_before_it_leaves(
    redis_url: str, home: Any, gateway: Any, tmp_path: Path, wait_until: Any
) -> None:
    import signal

    log = tmp_path / "demo.out"
    with open(log, "w") as stdout:
        demo = subprocess.Popen([CLI, "demo", "--calls", "3000", "--processes", "1", "--concurrency", "2"],
                                env=_env(home, HERMES_REDIS_URL=redis_url), stdout=stdout, stderr=subprocess.STDOUT,
                                preexec_fn=sigint_as_by_default)  # fmt: skip
    try:
        wait_until(lambda: _demo_leftovers(gateway.conn)["calls"] > 1000, timeout=60, message="the demo's batch")
        demo.send_signal(signal.SIGINT)  # Ctrl-C mid-batch
        demo.wait(60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
    text = log.read_text()
    assert "cancelled " in text and "unfinished calls of the demo" in text, text
    left = _demo_leftovers(gateway.conn)
    assert left["calls"] == 3001 and left["unended"] == 0, left
    assert (left["queued"], left["leases"], left["slots"]) == (0, 0, 0), left
    assert not [t for t in gateway.tools() if t.spec.name.startswith("demo_")]


def test_python_dash_m_runs_the_same_command_when_the_script_is_not_on_path(home: Any) -> None:
    # The seed's tip for "command not found": the module form works where the script is not on PATH.
    shutil.copy(ROOT / "examples" / "tools" / "hello.yaml", home.tools_dir / "hello.yaml")
    env = _env(home)
    env["PATH"] = "/usr/bin:/bin"  # no venv bin directory

    def module(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hermes_gateway", *args], env=env, capture_output=True, text=True, timeout=90)

    version = module("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout == "hermes-gateway v0.10.0\n"
    ran = module("tool", "run", "hello", '{"name": "Alice"}')
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "Hello, Alice!\n"


def test_a_broken_spec_file_is_one_warning_line_naming_file_line_and_problem(home: Any) -> None:
    (home.tools_dir / "broken.yaml").write_text('name: broken\nexecutor: command\ncommand: "echo hi\n  input_schema: [\n')
    out = _run(["tool", "list"], _env(home))
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        f"warning: skipped {home.tools_dir / 'broken.yaml'}: not valid YAML: line 5, column 1: found unexpected "
        "end of stream (while scanning a quoted scalar at line 3, column 10)"
    ], out.stderr
    detailed = _run(["--log-level", "debug", "tool", "list"], _env(home))
    assert "spec file problem in full" in detailed.stderr and 'command: "echo hi' in detailed.stderr


def test_a_typo_in_config_yaml_is_named_when_a_command_starts(home: Any, redis_url: str) -> None:
    # The seed's pitfall 6 spelling, mistyped: it would set nothing, silently.
    home.config({"executor": {"concurency": 3}, "workers": {"leese": 5}, "model": {"default": "m"}})
    out = _run(["tool", "list"], _env(home, HERMES_REDIS_URL=redis_url))
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "warning: config.yaml: workers.leese is not a setting (did you mean workers.lease?)",
        "warning: config.yaml: executor.concurency is not a setting (did you mean executor.concurrency?)",
    ], out.stderr


def test_help_names_hermes_home(home: Any) -> None:
    out = _run(["--help"], _env(home))
    assert out.returncode == 0
    assert "HERMES_HOME" in out.stdout and "~/.hermes" in out.stdout
