"""docker-compose.yml cannot run here (no Docker engine), so run each service's command line as compose
would — image entrypoint + command, with the service's environment — against a Redis started from the
redis service's own command, and check the stack works end to end."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from tests.e2e.util import free_port, wait_http

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.e2e


def _dockerfile() -> tuple[list[str], dict[str, str], list[tuple[str, str]]]:
    """ENTRYPOINT, ENV and COPY lines of the Dockerfile."""
    entry: list[str] = []
    env: dict[str, str] = {}
    copies: list[tuple[str, str]] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT"):
            entry = yaml.safe_load(line.split(None, 1)[1])
        elif line.startswith("ENV"):
            k, v = line.split(None, 1)[1].split("=", 1)
            env[k] = v
        elif line.startswith("COPY"):
            src, dst = [w for w in line.split()[1:] if not w.startswith("--")][:2]
            copies.append((src, dst))
    return entry, env, copies


def _argv(entry: list[str], command: list[str]) -> list[str]:
    argv = [*entry, *command]
    exe = BIN / argv[0]
    return [str(exe) if exe.exists() else argv[0], *argv[1:]]


def test_compose_publishes_only_on_loopback_waits_for_a_healthy_redis_and_the_image_is_not_root() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    # Whoever reaches Redis can register and run tools: nothing is published beyond this machine.
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    worker = services["worker"]
    assert worker["depends_on"]["redis"] == {"condition": "service_healthy"}
    assert worker["restart"] == "unless-stopped" and services["api"]["restart"] == "unless-stopped"
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_compose_services_run_as_written(tmp_path: Path) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    entry, image_env, copies = _dockerfile()
    assert entry == ["hermes-gateway"]
    assert any("pip install" in line for line in (ROOT / "Dockerfile").read_text().splitlines())

    # The image's HERMES_HOME: what the Dockerfile copies there.
    home = tmp_path / "hermes"
    for src, dst in copies:
        if dst.startswith(image_env["HERMES_HOME"]):
            shutil.copytree(ROOT / src, home / Path(dst).relative_to(image_env["HERMES_HOME"]))
    assert (home / "tools" / "hello.yaml").exists()

    # redis: its own command line, on a free port, in a scratch dir; AOF must be on.
    rcmd = services["redis"]["command"]
    assert "--appendonly" in rcmd and rcmd[rcmd.index("--appendonly") + 1] == "yes"
    port = free_port()
    rdir = tmp_path / "redis-data"
    rdir.mkdir()
    redis_proc = subprocess.Popen([*rcmd, "--port", str(port), "--dir", str(rdir), "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    procs = [redis_proc]
    try:
        conn = redis.Redis(port=port)
        for _ in range(200):
            try:
                conn.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        url_for = lambda svc_env: svc_env["HERMES_REDIS_URL"].replace("redis://redis:6379", f"redis://127.0.0.1:{port}")  # noqa: E731
        # redis's healthcheck, run as compose runs it (CMD-SHELL), against this Redis: healthy once it answers.
        check = services["redis"]["healthcheck"]["test"]
        assert check[0] == "CMD-SHELL"
        healthy = subprocess.run(["sh", "-c", check[1].replace("redis-cli ping", f"redis-cli -p {port} ping")], timeout=10)
        assert healthy.returncode == 0

        def env_of(name: str, shell: dict[str, str] | None = None) -> dict[str, str]:
            # ${VAR:-default} is read from the shell that runs compose, as compose does.
            shell = shell or {}
            svc_env = {
                k: re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: shell.get(m.group(1), m.group(2)), str(v))
                for k, v in services[name]["environment"].items()
            }
            env = {**os.environ, **image_env, **svc_env}
            env["HERMES_REDIS_URL"] = url_for(svc_env)
            env["HERMES_HOME"] = str(home)  # the image path /hermes, laid out under tmp
            return env

        def worker_argv() -> tuple[list[str], int]:
            # Each container has its own --metrics-port 9464; here they share one machine: a free port each,
            # on loopback (compose binds the container's every address so Prometheus reaches it).
            argv = _argv(entry, services["worker"]["command"])
            mport = free_port()
            argv[argv.index("--metrics-port") + 1] = str(mport)
            argv[argv.index("--metrics-host") + 1] = "127.0.0.1"
            return argv, mport

        worker_log = (tmp_path / "worker.log").open("wb")
        argv, metrics_port = worker_argv()
        worker = subprocess.Popen(argv, env=env_of("worker"), stderr=worker_log, stdout=worker_log)
        procs.append(worker)
        deadline = time.monotonic() + 30
        while conn.zcard("hermes:workers") < 1:
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            time.sleep(0.1)

        call = subprocess.run(
            _argv(entry, services["call"]["command"]), env=env_of("call"), capture_output=True, text=True, timeout=60
        )
        assert call.returncode == 0, call.stderr
        assert call.stdout.strip() == "Hello, Alice!"
        assert "done" in call.stderr and "trace_id=" in call.stderr  # --follow printed the transitions
        # The worker's own /metrics (what Prometheus scrapes from each replica) counted that call.
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert 'hermes_calls_total{' in scraped and 'hermes_call_name="hello"' in scraped

        # api: refuses to listen on every address without a token; with one, serves calls over HTTP.
        api_port = free_port()
        api_argv = [*_argv(entry, services["api"]["command"]), "--port", str(api_port)]
        no_token = subprocess.run(api_argv, env=env_of("api"), capture_output=True, text=True, timeout=60)
        assert no_token.returncode == 2 and "--token" in no_token.stderr
        api = subprocess.Popen(api_argv, env=env_of("api", {"HERMES_API_TOKEN": "t0ken"}), stderr=subprocess.DEVNULL)
        procs.append(api)
        wait_http(f"http://127.0.0.1:{api_port}/healthz", api)
        said = httpx.post(
            f"http://127.0.0.1:{api_port}/v1/tools/hello/calls",
            json={"args": {"name": "Bob"}, "wait": 30},
            headers={"Authorization": "Bearer t0ken"},
            timeout=40,
        ).json()
        assert said["state"] == "done" and said["result"].strip() == "Hello, Bob!"
        # The api's /metrics (no token needed, like /healthz): both calls, once the worker flushed its figures.
        def api_calls() -> float:
            text = httpx.get(f"http://127.0.0.1:{api_port}/metrics", timeout=10).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("hermes_calls_total{"))
        deadline = time.monotonic() + 10
        while api_calls() < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert api_calls() == 2
        api.terminate()
        assert api.wait(30) == 0

        # Scaling: a second worker from the same command joins the same queues.
        second = subprocess.Popen(worker_argv()[0], env=env_of("worker"), stderr=subprocess.DEVNULL)
        procs.append(second)
        deadline = time.monotonic() + 30
        while conn.zcard("hermes:workers") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # compose stop sends SIGTERM and waits stop_grace_period: the workers must exit 0 within it.
        grace = float(services["worker"]["stop_grace_period"].rstrip("s"))
        for p in (worker, second):
            p.terminate()
        for p in (worker, second):
            assert p.wait(grace) == 0
        assert list(rdir.glob("**/*.aof*")) or list(rdir.glob("appendonlydir/*")), "redis service must write its AOF"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_compose_commands_are_argv_lists() -> None:
    """No service relies on a shell: every command is an argv list."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        assert isinstance(svc.get("command"), list), f"{name}: command must be a list, not {shlex.quote(str(svc.get('command')))}"


def test_prometheus_scrapes_the_api_and_every_worker_replica_where_they_serve_metrics() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    prom = services["prometheus"]
    config_mount = next(v for v in prom["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro"))
    config = yaml.safe_load((ROOT / config_mount.split(":", 1)[0]).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    api_cmd = services["api"]["command"]
    assert jobs["hermes-api"]["static_configs"][0]["targets"] == [f"api:{api_cmd[api_cmd.index('--port') + 1]}"]
    worker_cmd = services["worker"]["command"]
    (dns,) = jobs["hermes-worker"]["dns_sd_configs"]
    assert dns["names"] == ["worker"] and str(dns["port"]) == worker_cmd[worker_cmd.index("--metrics-port") + 1]
    assert worker_cmd[worker_cmd.index("--metrics-host") + 1] == "0.0.0.0"  # reachable from the prometheus container
    assert services["api"]["environment"]["HERMES_TRACE_URL"] == "http://localhost:16686/trace/{trace_id}"
