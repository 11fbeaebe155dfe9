"""Without HERMES_REDIS_URL, CLI commands reach the gateway that runs here (review 17, D5, D6, D9).

A `serve` (or `worker`) of the same $HERMES_HOME records its embedded broker in the run registry; the
other commands attach to it, so `tool register` from a terminal lands in that serve's directory. When no
gateway runs, a command's broker ends with it: `tool register` keeps the spec in $HERMES_HOME/tools,
`status` says it is an empty throwaway broker, and `tool remove` does not pretend to remove a tool its
spec file brings back. Each test runs the real CLI as the user would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_cli import _env, _run
from tests.e2e.util import free_port, wait_http
from workers import runfiles

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).parent / "hermes-gateway")
WEATHER = ROOT / "examples" / "tools" / "get_weather.yaml"
HELLO = ROOT / "examples" / "tools" / "hello.yaml"
THROWAWAY = "the embedded broker lasts only for this command"


def _names(out: subprocess.CompletedProcess[str]) -> set[str]:
    assert out.returncode == 0, out.stdout + out.stderr
    return {row["name"] for row in json.loads(out.stdout)}


def _wait_for_kinds(home: Any, kinds: set[str], timeout: float = 60) -> dict[str, dict[str, Any]]:
    run = home.path / "run"
    deadline = time.monotonic() + timeout
    while True:
        files = [json.loads(p.read_text()) for p in sorted(run.glob("*.json"))] if run.is_dir() else []
        by_kind = {f["kind"]: f for f in files}
        if kinds <= set(by_kind) and by_kind.get("serve", {}).get("url"):
            return by_kind
        assert time.monotonic() < deadline, f"timed out waiting for run files {kinds}: {files}"
        time.sleep(0.05)


def _stop(env: dict[str, str], proc: subprocess.Popen[Any], log: Any) -> None:
    out = _run(["stop", "--all"], env, timeout=60)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.seek(0)
    print(log.read(), out.stdout, out.stderr)


def test_with_serve_running_the_commands_of_the_same_home_use_its_broker(home: Any, tmp_path: Path) -> None:
    shutil.copy(HELLO, home.tools_dir / "hello.yaml")
    env = _env(home)  # no HERMES_REDIS_URL: serve runs the embedded broker and a local worker
    port = free_port()
    with open(tmp_path / "serve.log", "w+") as log:
        serve = subprocess.Popen([CLI, "serve", "--port", str(port)], env=env, stdout=log, stderr=log, text=True)
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz", serve, timeout=60)
            by_kind = _wait_for_kinds(home, {"serve", "worker", "broker"})
            socket_url = by_kind["broker"]["url"]
            attached = f"broker: the embedded broker of serve (pid {serve.pid}) at {socket_url}"

            # `tool register` from another terminal lands in serve's directory: its API and `tool list` see it.
            reg = _run(["tool", "register", str(WEATHER)], env)
            assert reg.returncode == 0, reg.stderr
            assert reg.stdout.startswith("get_weather: registered (version ")
            assert attached in reg.stderr.splitlines()
            assert THROWAWAY not in reg.stderr
            assert not (home.tools_dir / "get_weather.yaml").exists()  # a real directory: no file needed
            api = httpx.get(f"http://127.0.0.1:{port}/v1/tools", timeout=10).json()
            assert {"get_weather", "hello"} <= {row["name"] for row in api}
            listed = _run(["tool", "list", "--json"], env)
            assert {"get_weather", "hello"} <= _names(listed)
            assert attached in listed.stderr

            # `status` sees serve's local worker on that broker.
            status = _run(["status", "--json"], env)
            assert status.returncode == 0, status.stderr
            data = json.loads(status.stdout)
            assert data["broker"].startswith(f"the embedded broker of serve (pid {serve.pid})")
            assert len(data["workers"]) >= 1
            assert THROWAWAY not in status.stderr

            # `tool run` uses serve's worker (it starts none of its own) ...
            run = _run(["tool", "run", "hello", "{name: Alice}"], env)
            assert run.returncode == 0, run.stderr
            assert run.stdout == "Hello, Alice!\n"
            assert "started" not in run.stderr

            # ... and `events` finds a call made through serve's API.
            call = httpx.post(
                f"http://127.0.0.1:{port}/v1/tools/hello/calls", json={"args": {"name": "Bob"}, "wait": 20}, timeout=30
            ).json()
            events = _run(["events", call["call_id"]], env)
            assert events.returncode == 0, events.stderr
            # (an ended call keeps its end alone: the moves before it are rebuilt from its steps, as --follow does)
            assert [ln.split()[2] for ln in events.stdout.splitlines()] == ["pending", "routing", "executing", "formatting", "done"]
            # The audit log and control messages live in that broker too.
            audit = _run(["audit", "show", call["call_id"], "--json"], env)
            assert audit.returncode == 0 and attached in audit.stderr, audit.stderr
            assert json.loads(audit.stdout)["record"]["tool_name"] == "hello"
            reload = _run(["plugins", "reload"], env)
            assert reload.returncode == 0, reload.stderr
            assert reload.stdout.startswith(f"reload sent to workers on the embedded broker of serve (pid {serve.pid})")

            # A tool removed from the terminal is gone from serve's directory too.
            removed = _run(["tool", "remove", "get_weather"], env)
            assert removed.returncode == 0 and removed.stdout == "get_weather: removed\n", removed.stderr
            api = httpx.get(f"http://127.0.0.1:{port}/v1/tools", timeout=10).json()
            assert "get_weather" not in {row["name"] for row in api}
        finally:
            _stop(env, serve, log)


def test_with_a_worker_running_tool_register_reaches_its_broker_and_tool_run_adds_a_missing_worker(
    home: Any, tmp_path: Path
) -> None:
    env = _env(home)
    with open(tmp_path / "worker.log", "w+") as log:
        # A worker of the LLM queue only: `tool run` starts a tools worker of its own on that broker.
        worker = subprocess.Popen([CLI, "worker", "--queues", "llm", "-c", "2"], env=env, stdout=log, stderr=log, text=True)
        try:
            deadline = time.monotonic() + 60
            while not _broker_url(home):
                assert time.monotonic() < deadline and worker.poll() is None, "the worker's broker did not start"
                time.sleep(0.05)
            reg = _run(["tool", "register", str(WEATHER)], env)
            assert reg.returncode == 0, reg.stderr
            assert f"broker: the embedded broker of worker (pid {worker.pid}) at unix://" in reg.stderr
            assert "get_weather" in _names(_run(["tool", "list", "--json"], env))
            assert not (home.tools_dir / "get_weather.yaml").exists()

            shutil.copy(HELLO, home.tools_dir / "hello.yaml")
            ran = _run(["tool", "run", "hello", "{name: Alice}"], env)
            assert ran.returncode == 0, ran.stderr
            assert ran.stdout == "Hello, Alice!\n"
            assert ran.stderr.splitlines() == [
                f"broker: the embedded broker of worker (pid {worker.pid}) at {_broker_url(home)}; "
                "no worker listens on tools: started 1 for this command"
            ]
        finally:
            _stop(env, worker, log)


def _broker_url(home: Any) -> str:
    """The URL the run registry records for the embedded broker ("" before there is one)."""
    run = home.path / "run"
    files = [json.loads(p.read_text()) for p in run.glob("*.json")] if run.is_dir() else []
    return next((f["url"] for f in files if f["kind"] == "broker" and f.get("url")), "")


def test_without_a_gateway_running_tool_register_keeps_the_spec_in_the_tools_dir(home: Any) -> None:
    env = _env(home)
    # A registry entry of a serve that died (its pid is gone) is not attached to: a fresh broker is used.
    dead = subprocess.Popen(["true"])
    dead.wait()
    run_dir = runfiles.run_dir(home.path)
    runfiles.register("serve", pid=dead.pid, port=1, directory=run_dir)
    runfiles.register("broker", pid=dead.pid + 1_000_000, parent=dead.pid, url="unix:///nonexistent/redis.sock", directory=run_dir)

    reg = _run(["tool", "register", str(WEATHER)], env)

    target = home.tools_dir / "get_weather.yaml"
    assert reg.returncode == 0, reg.stderr
    assert reg.stdout == "get_weather: registered (version 1)\n"
    assert "broker: the embedded broker of" not in reg.stderr
    assert f"note: {THROWAWAY}" in reg.stderr and f"the spec was written to {target} so every command loads it" in reg.stderr
    assert target.read_text(encoding="utf-8") == WEATHER.read_text(encoding="utf-8")
    # The tool survives to the next command.
    assert "get_weather" in _names(_run(["tool", "list", "--json"], env))
    shown = _run(["tool", "show", "get_weather"], env)
    assert shown.returncode == 0 and "name: get_weather" in shown.stdout, shown.stderr

    # The same spec again: nothing to write.
    again = _run(["tool", "register", str(WEATHER)], env)
    assert again.returncode == 0, again.stderr
    assert f"the spec is already in {target}" in again.stderr

    # A different spec of that name does not silently replace the file: --force does.
    changed = home.path / "weather2.yaml"
    changed.write_text(WEATHER.read_text(encoding="utf-8").replace("description:", "description: NEW", 1), encoding="utf-8")
    refused = _run(["tool", "register", str(changed)], env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stdout == ""
    assert f"error: {target} holds a different spec than {changed}" in refused.stderr and "--force" in refused.stderr
    assert target.read_text(encoding="utf-8") == WEATHER.read_text(encoding="utf-8")
    forced = _run(["tool", "register", str(changed), "--force"], env)
    assert forced.returncode == 0, forced.stderr
    assert target.read_text(encoding="utf-8") == changed.read_text(encoding="utf-8")
    assert not list(home.tools_dir.glob(".*"))  # no temp file left behind

    # `status` says in one line that it looks at a broker of its own.
    status = _run(["status"], env)
    assert status.returncode == 0, status.stderr
    notes = [ln for ln in status.stderr.splitlines() if THROWAWAY in ln]
    assert len(notes) == 1 and notes[0].startswith("note: "), status.stderr


def test_tool_remove_of_a_tool_with_a_spec_file_says_so_and_can_delete_the_file(home: Any, redis_url: str) -> None:
    spec = home.tools_dir / "hello.yaml"
    shutil.copy(HELLO, spec)
    env = _env(home)

    # On a broker of its own: removing is pointless while the file brings the tool back; no "unknown tool".
    kept = _run(["tool", "remove", "hello"], env)
    assert kept.returncode == 1, kept.stdout + kept.stderr
    assert "unknown tool" not in kept.stderr
    assert f"error: hello is not removed: {spec} registers it for every command" in kept.stderr
    assert "hermes-gateway tool remove hello --delete-file" in kept.stderr
    assert "hello" in _names(_run(["tool", "list", "--json"], env))

    # On a shared broker: removed, with a warning that the file registers it again.
    shared = _env(home, HERMES_REDIS_URL=redis_url)
    assert "hello" in _names(_run(["tool", "list", "--json"], shared))
    warned = _run(["tool", "remove", "hello"], shared)
    assert warned.returncode == 0, warned.stderr
    assert warned.stdout == "hello: removed\n"
    assert f"warning: {spec} registers hello again on the next command" in warned.stderr
    assert "--delete-file" in warned.stderr

    # --delete-file removes it for good, on either broker.
    gone = _run(["tool", "remove", "hello", "--delete-file"], shared)
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout == f"hello: removed; deleted {spec}\n"
    assert not spec.exists()
    assert "hello" not in _names(_run(["tool", "list", "--json"], shared))
    unknown = _run(["tool", "remove", "hello"], env)
    assert unknown.returncode == 2 and "error: unknown tool 'hello'" in unknown.stderr


@pytest.mark.parametrize("follow", [False, True])
def test_events_of_an_unknown_call_is_an_error(home: Any, redis_url: str, follow: bool) -> None:
    extra = ["--follow"] if follow else []
    for env in (_env(home), _env(home, HERMES_REDIS_URL=redis_url)):
        out = _run(["events", "deadbeef", *extra], env, timeout=30)
        assert out.returncode == 1, out.stdout + out.stderr
        assert out.stdout == ""
        assert "error: no such call deadbeef (unknown, or past its result TTL)" in out.stderr
