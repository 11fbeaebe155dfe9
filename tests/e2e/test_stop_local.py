"""`hermes-gateway stop --all` stops what runs on this machine, broker or not: the seed's pitfall 8 (port
8787 taken: `stop --all` frees it). Real `serve` / `worker` processes with their embedded brokers, found
through the run registry ($HERMES_HOME/run), each run as the user would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.e2e.util import free_port, wait_http
from workers import runfiles

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).parent / "hermes-gateway")


def _env(home: Any, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env["HERMES_HOME"] = str(home.path)
    env.update(extra)
    return env


def _stop_all(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "stop", "--all", *args], env=env, capture_output=True, text=True, timeout=timeout)


def _run_files(home: Any) -> dict[str, dict[str, Any]]:
    run = home.path / "run"
    return {p.name: json.loads(p.read_text()) for p in sorted(run.glob("*.json"))} if run.is_dir() else {}


def _files(home: Any, count: int) -> Any:
    """A predicate: the run files once there are ``count`` of them."""
    return lambda: (files if len(files := _run_files(home)) == count else None)


def _wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_stop_all_without_a_broker_url_stops_serve_its_worker_and_its_embedded_broker(home: Any, tmp_path: Path) -> None:
    port = free_port()
    env = _env(home)  # no HERMES_REDIS_URL: serve starts the embedded broker and a local worker
    with open(tmp_path / "serve.log", "w+") as log:
        serve = subprocess.Popen([CLI, "serve", "--port", str(port)], env=env, stdout=log, stderr=log, text=True)
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz", serve, timeout=60)
            files = _wait_for(_files(home, 3), 30, "three run files")
            by_kind = {f["kind"]: f for f in files.values()}
            assert set(by_kind) == {"serve", "worker", "broker"}, files
            assert by_kind["serve"]["pid"] == serve.pid and by_kind["serve"]["port"] == port
            broker_pid, worker_pid = by_kind["broker"]["pid"], by_kind["worker"]["pid"]
            assert by_kind["broker"]["parent"] == serve.pid and by_kind["worker"]["parent"] == serve.pid
            assert "redis-server" in " ".join(psutil.Process(broker_pid).cmdline())
            socket_dir = Path(by_kind["broker"]["url"].removeprefix("unix://")).parent
            assert socket_dir.is_dir()

            out = _stop_all(env)

            assert out.returncode == 0, out.stdout + out.stderr
            assert f"serve on http://127.0.0.1:{port}/ pid {serve.pid}: stopped" in out.stdout
            assert f"pid {broker_pid}: stopped" in out.stdout and f"pid {worker_pid}: stopped" in out.stdout
            # stop returns once they are gone: serve exited through its own cleanup (code 0, not killed) ...
            assert serve.wait(2) == 0
            # ... so the port is free, its worker and its broker are gone and the broker's socket dir removed.
            assert _port_free(port)
            assert _gone(broker_pid) and _gone(worker_pid)
            assert not any(
                "redis-server" in " ".join(p.info["cmdline"] or []) and str(socket_dir) in " ".join(p.info["cmdline"] or [])
                for p in psutil.process_iter(["cmdline"])
            )
            assert not socket_dir.exists()
            assert _run_files(home) == {}
        finally:
            _kill(serve)
            log.seek(0)
            print(log.read())


def test_stop_all_stops_a_worker_pool_and_its_embedded_broker(home: Any, tmp_path: Path) -> None:
    env = _env(home)
    with open(tmp_path / "worker.log", "w+") as log:
        pool = subprocess.Popen([CLI, "worker", "-p", "2", "-c", "2"], env=env, stdout=log, stderr=log)
        try:
            files = _wait_for(_files(home, 4), 60, "four run files")
            kinds = sorted(f["kind"] for f in files.values())
            assert kinds == ["broker", "pool", "worker", "worker"], files
            pids = [f["pid"] for f in files.values()]
            assert all(not _gone(pid) for pid in pids)

            out = _stop_all(env)

            assert out.returncode == 0, out.stdout + out.stderr
            assert f"pool pid {pool.pid}: stopped" in out.stdout
            assert pool.wait(2) == 0
            assert all(_gone(pid) for pid in pids)
            assert _run_files(home) == {}
        finally:
            _kill(pool)
            log.seek(0)
            print(log.read())


def test_run_files_are_owner_only_and_hold_no_broker_password(home: Any) -> None:
    path = runfiles.register("worker", url="redis://:s3cret-pw@db.internal:6379/0", directory=runfiles.run_dir(home.path))
    assert path is not None
    try:
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
        text = path.read_text()
        assert "s3cret-pw" not in text and json.loads(text)["url"] == "redis://:***@db.internal:6379/0"
    finally:
        runfiles.unregister(path)


def _has_worker_child(pid: int) -> bool:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    for child in children:
        try:
            if "workers" in child.cmdline():
                return True
        except psutil.Error:
            continue
    return False


def test_a_tool_runs_private_worker_is_its_commands_not_stop_alls(home: Any) -> None:
    home.tool("slow", executor="command", command=[sys.executable, "-c", "import time; time.sleep(3); print('slept')"], timeout=30)
    env = _env(home)
    run = subprocess.Popen([CLI, "tool", "run", "slow"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _has_worker_child(run.pid), 30, "its worker")
        assert _run_files(home) == {}  # neither the command's worker nor its embedded broker is recorded
        out = _stop_all(env)
        assert out.returncode == 0 and "nothing running on this machine" in out.stdout, out.stdout
        stdout, stderr = run.communicate(timeout=60)
        assert run.returncode == 0, stderr
        assert stdout == "slept\n"
    finally:
        _kill(run)


def test_a_stale_run_file_is_dropped_and_a_reused_pid_is_not_signalled(home: Any) -> None:
    run = runfiles.run_dir(home.path)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    runfiles.register("worker", pid=exited.pid, directory=run)
    # A live process that is not ours now holds a recorded pid: its command line is not a serve's.
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        runfiles.register("serve", pid=bystander.pid, port=8787, directory=run)
        assert len(_run_files(home)) == 2

        out = _stop_all(_env(home))

        assert out.returncode == 0, out.stderr
        assert f"worker pid {exited.pid}: was not running (stale run file removed)" in out.stdout
        assert f"pid {bystander.pid}: was not running (stale run file removed)" in out.stdout
        assert "nothing running on this machine" in out.stdout
        assert bystander.poll() is None  # never signalled
        assert _run_files(home) == {}
    finally:
        _kill(bystander)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(home: Any) -> None:
    # A process of ours (its command line names `workers`) that does not exit on SIGTERM.
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    stuck = subprocess.Popen([sys.executable, "-c", code, "workers"], stdout=subprocess.PIPE, text=True)
    try:
        assert stuck.stdout is not None and stuck.stdout.readline() == "ready\n"
        runfiles.register("worker", pid=stuck.pid, parent=os.getpid(), directory=runfiles.run_dir(home.path))
        started = time.monotonic()

        out = _stop_all(_env(home), "--grace", "1")

        assert out.returncode == 0, out.stderr
        assert f"worker pid {stuck.pid}: killed (still running 1s after SIGTERM)" in out.stdout
        assert stuck.wait(2) == -signal.SIGKILL
        assert 1 <= time.monotonic() - started < 15
        assert _run_files(home) == {}
    finally:
        _kill(stuck)


def test_stop_all_with_nothing_running_and_no_broker_says_so(home: Any) -> None:
    out = _stop_all(_env(home))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"nothing running on this machine (run registry {home.path / 'run'})\n"
    assert out.stderr == ""


def test_stop_names_still_needs_a_broker(home: Any) -> None:
    out = subprocess.run([CLI, "stop", "w1"], env=_env(home), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "HERMES_REDIS_URL is not set" in out.stderr


def test_serve_on_a_broker_obeys_the_control_channels_stop(redis_url: str, home: Any, tmp_path: Path) -> None:
    port = free_port()
    serve_home = tmp_path / "serve-home"
    (serve_home / "tools").mkdir(parents=True)
    serve_env = dict(_env(home, HERMES_REDIS_URL=redis_url), HERMES_HOME=str(serve_home))
    serve = subprocess.Popen(
        [CLI, "serve", "--port", str(port)], env=serve_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", serve, timeout=60)
        # Another home, so its run registry does not hold this serve: only the broker's message reaches it,
        # as it would reach a serve on another host.
        out = _stop_all(_env(home, HERMES_REDIS_URL=redis_url))
        assert out.returncode == 0, out.stderr
        assert "stop sent to all workers on Redis" in out.stdout
        assert serve.wait(15) == 0
        assert _port_free(port)
        assert not any((serve_home / "run").glob("*.json"))
    finally:
        _kill(serve)
