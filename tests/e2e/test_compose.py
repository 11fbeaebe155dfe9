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
from typing import Any

import httpx
import pytest
import redis
import yaml

from tests.e2e.util import free_port, wait_http
from tests.redis_stack import cluster_port

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


# -- the "sentinel" and "cluster" profiles ---------------------------------------------------------


def _services() -> dict[str, dict[str, object]]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def _in_profile(services: dict[str, dict[str, object]], profile: str) -> dict[str, dict[str, object]]:
    return {n: s for n, s in services.items() if profile in (s.get("profiles") or [])}


def _opts(command: list[str], flag: str) -> list[list[str]]:
    """The words after each ``--sentinel``-style flag up to the next ``--`` word."""
    out, i = [], 0
    while i < len(command):
        if command[i] == flag:
            j = i + 1
            while j < len(command) and not command[j].startswith("--"):
                j += 1
            out.append(command[i + 1 : j])
            i = j
        else:
            i += 1
    return out


def test_the_default_profile_is_one_redis_and_the_profiles_name_their_own_nodes() -> None:
    services = _services()
    default = {n: s for n, s in services.items() if not s.get("profiles")}
    redis_servers = [n for n, s in default.items() if "redis-server" in (s.get("command") or [])]
    assert redis_servers == ["redis"]
    assert default["worker"]["environment"]["HERMES_REDIS_URL"] == "redis://redis:6379/0"  # type: ignore[index]

    sentinel = _in_profile(services, "sentinel")
    assert {"redis-primary", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3", "worker-sentinel", "api-sentinel"} <= set(sentinel)
    replica = sentinel["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 : replica.index("--replicaof") + 3] == ["redis-primary", "6379"]  # type: ignore[union-attr]
    volumes = set()
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        command = sentinel[name]["command"]
        assert command[:3] == ["redis-server", "/data/sentinel.conf", "--sentinel"]  # type: ignore[index]
        assert ["monitor", "mymaster", "redis-primary", "6379", "2"] in _opts(command, "--sentinel")  # type: ignore[arg-type]
        volumes.add(tuple(sentinel[name]["volumes"]))  # type: ignore[arg-type]
    assert len(volumes) == 3  # a config file each: a Sentinel rewrites its own
    for name in ("worker-sentinel", "api-sentinel"):
        url = sentinel[name]["environment"]["HERMES_REDIS_URL"]  # type: ignore[index]
        assert url == "redis+sentinel://sentinel-1:26379,sentinel-2:26379,sentinel-3:26379/mymaster/0"
        assert sentinel[name]["environment"]["HERMES_WAIT_REPLICAS"] == "1"  # type: ignore[index]

    cluster = _in_profile(services, "cluster")
    nodes = [n for n, s in cluster.items() if "--cluster-enabled" in (s.get("command") or [])]
    assert len(nodes) == 6
    create = cluster["cluster-create"]["command"]
    assert create[:3] == ["redis-cli", "--cluster", "create"]  # type: ignore[index]
    assert sorted(create[3:9]) == sorted(f"{n}:6379" for n in nodes)  # type: ignore[index]
    assert create[create.index("--cluster-replicas") + 1] == "1" and "--cluster-yes" in create  # type: ignore[union-attr]
    for name in ("worker-cluster", "api-cluster"):
        url = str(cluster[name]["environment"]["HERMES_REDIS_URL"])  # type: ignore[index]
        assert url.startswith("redis+cluster://")
        assert {h.split(":")[0] for h in url.split("://", 1)[1].split(",")} <= set(nodes)
    assert cluster["worker-cluster"]["depends_on"]["cluster-create"] == {"condition": "service_completed_successfully"}  # type: ignore[index]
    # No profile's service starts the others' nodes.
    assert not set(sentinel) & set(cluster)


class _Local:
    """Runs compose services' command lines here: each service name is 127.0.0.1 with a port of its own."""

    def __init__(self, tmp: Path, ports: Any = free_port) -> None:
        self.tmp, self.ports, self.procs, self.free = tmp, {}, [], ports  # type: ignore[var-annotated]

    def port(self, service: str) -> int:
        if service not in self.ports:
            self.ports[service] = self.free()
        return self.ports[service]  # type: ignore[no-any-return]

    def argv(self, command: list[str], services: set[str]) -> list[str]:
        """Service names (alone, ``name:port``, or ``name port``) become 127.0.0.1 and its local port."""
        out: list[str] = []
        for i, word in enumerate(command):
            host, _, port = word.partition(":")
            if host in services and port.isdigit():
                out.append(f"127.0.0.1:{self.port(host)}")
            elif word in services:
                out.append("127.0.0.1")
            elif i > 0 and command[i - 1] in services and word.isdigit():
                out.append(str(self.port(command[i - 1])))
            else:
                out.append(word)
        return out

    def url(self, url: str, services: set[str]) -> str:
        scheme, rest = url.split("://", 1)
        hosts, _, path = rest.partition("/")
        local = ",".join(self.argv([h], services)[0] for h in hosts.split(","))
        return f"{scheme}://{local}" + (f"/{path}" if path else "")

    def start(self, argv: list[str], name: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, cwd=cwd or self.tmp)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _until(predicate: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _image_home(tmp: Path) -> Path:
    _, image_env, copies = _dockerfile()
    home = tmp / "hermes"
    for src, dst in copies:
        if dst.startswith(image_env["HERMES_HOME"]):
            shutil.copytree(ROOT / src, home / Path(dst).relative_to(image_env["HERMES_HOME"]))
    return home


def test_the_sentinel_profile_runs_as_written_and_serves_calls(tmp_path: Path) -> None:
    services = _services()
    sentinel = _in_profile(services, "sentinel")
    names = set(sentinel)
    entry, image_env, _ = _dockerfile()
    home = _image_home(tmp_path)
    local = _Local(tmp_path)
    try:
        for name in ("redis-primary", "redis-replica"):
            argv = local.argv(sentinel[name]["command"], names)  # type: ignore[arg-type]
            (tmp_path / name).mkdir()
            local.start([*argv, "--port", str(local.port(name)), "--bind", "127.0.0.1"], name, cwd=tmp_path / name)
        replica = redis.Redis(port=local.port("redis-replica"))
        _until(lambda: replica.info("replication")["master_link_status"] == "up", "the replica to sync")
        # sentinel-init, as written, on the three Sentinels' volumes (here: directories).
        init = sentinel["sentinel-init"]["command"]
        mounts = {v.split(":")[1]: tmp_path / v.split(":")[0] for v in sentinel["sentinel-init"]["volumes"]}  # type: ignore[union-attr]
        for d in mounts.values():
            d.mkdir()
        run = [next((str(mounts[m] / Path(w).name) for m in mounts if w.startswith(m + "/")), w) for w in init]  # type: ignore[union-attr]
        assert subprocess.run(run, timeout=30).returncode == 0
        for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
            volume = tmp_path / sentinel[name]["volumes"][0].split(":")[0]  # type: ignore[index]
            assert (volume / "sentinel.conf").exists()
            argv = local.argv(sentinel[name]["command"], names)  # type: ignore[arg-type]
            argv[argv.index("--port") + 1] = str(local.port(name))
            argv[1] = str(volume / "sentinel.conf")
            local.start([*argv, "--bind", "127.0.0.1"], name, cwd=volume)
        # Each Sentinel's healthcheck, as compose runs it, against this one.
        for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
            check = sentinel[name]["healthcheck"]["test"]  # type: ignore[index]
            shell = check[1].replace("-p 26379", f"-p {local.port(name)}")
            _until(lambda shell=shell: subprocess.run(["sh", "-c", shell], timeout=10).returncode == 0, f"{name} healthy")
            s = redis.Redis(port=local.port(name))
            _until(lambda s=s: int(s.sentinel_master("mymaster")["num-other-sentinels"]) >= 2, "Sentinels to meet")

        def env_of(name: str, shell: dict[str, str] | None = None) -> dict[str, str]:
            svc_env = {
                k: re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: (shell or {}).get(m.group(1), m.group(2)), str(v))
                for k, v in sentinel[name]["environment"].items()  # type: ignore[union-attr]
            }
            env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
            env.update({**image_env, **svc_env})
            env["HERMES_REDIS_URL"] = local.url(svc_env["HERMES_REDIS_URL"], names)
            env["HERMES_HOME"] = str(home)
            return env

        local.start(_argv(entry, sentinel["worker-sentinel"]["command"]), "worker-sentinel", env_of("worker-sentinel"))  # type: ignore[arg-type]
        primary = redis.Redis(port=local.port("redis-primary"))
        _until(lambda: primary.zcard("hermes:workers") >= 1, "the worker's heartbeat on the primary")
        api_port = free_port()
        api = local.start(
            [*_argv(entry, sentinel["api-sentinel"]["command"]), "--port", str(api_port)],  # type: ignore[arg-type]
            "api-sentinel",
            env_of("api-sentinel", {"HERMES_API_TOKEN": "t0ken"}),
        )
        wait_http(f"http://127.0.0.1:{api_port}/healthz", api)
        said = httpx.post(
            f"http://127.0.0.1:{api_port}/v1/tools/hello/calls",
            json={"args": {"name": "Sentinel"}, "wait": 30},
            headers={"Authorization": "Bearer t0ken"},
            timeout=40,
        ).json()
        assert said["state"] == "done" and said["result"].strip() == "Hello, Sentinel!", local.log("api-sentinel")
        assert replica.exists(f"rq:job:{said['call_id']}")  # confirmed on the replica (HERMES_WAIT_REPLICAS)
    finally:
        local.stop()


def _start_cluster(local: _Local, cluster: dict[str, dict[str, Any]]) -> list[str]:
    """The six nodes and cluster-create, each as written; the node names."""
    names = set(cluster)
    nodes = sorted(n for n, s in cluster.items() if "--cluster-enabled" in (s.get("command") or []))
    for name in nodes:
        (local.tmp / name).mkdir()
        argv = local.argv(cluster[name]["command"], names)
        local.start([*argv, "--port", str(local.port(name)), "--bind", "127.0.0.1"], name, cwd=local.tmp / name)
    for name in nodes:
        _until(redis.Redis(port=local.port(name)).ping, f"{name} up")
    create = subprocess.run(local.argv(cluster["cluster-create"]["command"], names), capture_output=True, text=True, timeout=120)
    assert create.returncode == 0, create.stdout[-3000:] + create.stderr[-3000:]
    first = redis.Redis(port=local.port(nodes[0]))
    _until(lambda: first.cluster("info")["cluster_state"] == "ok", "cluster_state:ok")
    _until(lambda: all(len(r) == 4 for r in first.execute_command("CLUSTER", "SLOTS")), "each replica to join")
    return nodes


def test_the_cluster_profile_creates_three_primaries_with_a_replica_each(tmp_path: Path) -> None:
    cluster = _in_profile(_services(), "cluster")
    local = _Local(tmp_path, cluster_port)  # a node's bus listens on its port + 10000
    try:
        nodes = _start_cluster(local, cluster)
        roles = [redis.Redis(port=local.port(n)).info("replication")["role"] for n in nodes]
        assert sorted(roles) == ["master"] * 3 + ["slave"] * 3
        # Three slot ranges covering every slot, each served by a primary and its replica, reached at the
        # endpoint each node announces (its service name; here 127.0.0.1): clients follow MOVED there.
        ranges = redis.Redis(port=local.port(nodes[0])).execute_command("CLUSTER", "SLOTS")
        assert len(ranges) == 3 and sum(int(r[1]) - int(r[0]) + 1 for r in ranges) == 16384
        announced = {(r[i][0].decode(), int(r[i][1])) for r in ranges for i in (2, 3)}
        assert announced == {("127.0.0.1", local.port(n)) for n in nodes}
    finally:
        local.stop()


def test_the_cluster_profile_workers_and_api_serve_calls(tmp_path: Path) -> None:
    from broker.connection import from_url
    from broker.errors import HermesError

    cluster = _in_profile(_services(), "cluster")
    names = set(cluster)
    entry, image_env, _ = _dockerfile()
    home = _image_home(tmp_path)
    try:  # (nothing listens there: only whether the scheme is known is asked)
        from_url(f"redis+cluster://127.0.0.1:{free_port()}").close()
    except HermesError as e:
        if "must specify one of the following schemes" in str(e):
            pytest.skip(f"redis+cluster:// URLs come with the cluster-safe key layout (branch scaleout): {e}")
    local = _Local(tmp_path, cluster_port)
    try:
        _start_cluster(local, cluster)

        def env_of(name: str, shell: dict[str, str] | None = None) -> dict[str, str]:
            svc_env = {
                k: re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: (shell or {}).get(m.group(1), m.group(2)), str(v))
                for k, v in cluster[name]["environment"].items()  # type: ignore[union-attr]
            }
            env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
            env.update({**image_env, **svc_env})
            env["HERMES_REDIS_URL"] = local.url(svc_env["HERMES_REDIS_URL"], names)
            env["HERMES_HOME"] = str(home)
            return env

        local.start(_argv(entry, cluster["worker-cluster"]["command"]), "worker-cluster", env_of("worker-cluster"))  # type: ignore[arg-type]
        api_port = free_port()
        api = local.start(
            [*_argv(entry, cluster["api-cluster"]["command"]), "--port", str(api_port)],  # type: ignore[arg-type]
            "api-cluster",
            env_of("api-cluster", {"HERMES_API_TOKEN": "t0ken"}),
        )
        wait_http(f"http://127.0.0.1:{api_port}/healthz", api)
        deadline = time.monotonic() + 60
        while True:  # the worker registers on the cluster meanwhile
            said = httpx.post(
                f"http://127.0.0.1:{api_port}/v1/tools/hello/calls",
                json={"args": {"name": "Cluster"}, "wait": 30},
                headers={"Authorization": "Bearer t0ken"},
                timeout=40,
            ).json()
            if said.get("state") == "done" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert said["state"] == "done" and said["result"].strip() == "Hello, Cluster!", (said, local.log("worker-cluster"))
    finally:
        local.stop()
