"""Shared fixtures: a test Redis database, a fake one, a HERMES_HOME, a Gateway and real worker processes."""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fakeredis
import pytest
import redis
import yaml

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TEST_REDIS_URL = "redis://127.0.0.1:6379/9"

# Built-in python-executor callables (workers/executors/builtin.py) that most tests run.
ECHO = "workers.executors.builtin:echo"
SLEEP = "workers.executors.builtin:sleep"
NOOP = "workers.executors.builtin:noop"
# The helper tools' cluster-wide concurrency limit: high, so tests about other things are not throttled by
# the default of 5 (tests about limits pass ``concurrency=``).
HELPER_CONCURRENCY = 1000


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    # Keep each phase's report on the item so fixtures can tell, at teardown, whether the test failed.
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # ``make test`` relies on --dist loadgroup to run a module marked xdist_group on one worker (a shared
    # hermes-agent venv, a script cache). pytest-xdist marks those items by suffixing "@group" to their node
    # id; pytest 9.2 stopped reading that attribute, and the groups were silently spread over every worker
    # (four 38 s venv builds waiting on one lock). Fail the run instead of losing the grouping again.
    if os.environ.get("PYTEST_XDIST_WORKER") and getattr(config.option, "loadgroup", False):
        lost = [
            item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
        ]
        if lost:
            raise pytest.UsageError(
                f"--dist loadgroup did not group {lost[0]} (and {len(lost) - 1} more): this pytest-xdist does "
                "not work with this pytest; keep the versions pyproject.toml pins"
            )


def _failed(node: pytest.Item) -> bool:
    return any(getattr(getattr(node, f"rep_{when}", None), "failed", False) for when in ("setup", "call"))


# -- waiting -----------------------------------------------------------------------------------


def sigint_as_by_default() -> None:
    """A ``preexec_fn`` for a child a test sends Ctrl-C (SIGINT): it gets the signal's default handling even
    when the test run itself was started with SIGINT ignored (a shell's background job, ``nohup``), which a
    child would inherit across exec."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, message: str = ""
) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {message or predicate}")
        time.sleep(interval)


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    """``wait_until(predicate, timeout=10, interval=0.02, message="")`` as a fixture."""
    return wait_until


# -- Redis -------------------------------------------------------------------------------------


def redis_test_url() -> str:
    """The test database's URL: ``HERMES_TEST_REDIS_URL`` (default db 9), one database further per xdist worker.

    Under ``pytest -n N`` each worker flushes its own database (gw0 the base, gw1 the next, ...), so the
    workers never wait on one another's lock nor see one another's keys.
    """
    url = os.environ.get("HERMES_TEST_REDIS_URL") or DEFAULT_TEST_REDIS_URL
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return url
    parsed = urlparse(url)
    base = int((parsed.path or "/0").lstrip("/") or "0")
    db = base + int(worker[2:])
    if db > 15:  # (redis.conf's default ``databases 16``)
        pytest.fail(f"xdist worker {worker} needs db {db} after {url}: lower -n or the base db index")
    return parsed._replace(path=f"/{db}").geturl()


@pytest.fixture
def redis_url() -> Iterator[str]:
    """URL of the dedicated test database (``HERMES_TEST_REDIS_URL``, default db 9), flushed first.

    Held under a file lock for the whole test, so two pytest runs on one machine (two engineers, or
    a run beside CI) take turns on the database instead of flushing it under each other.
    """
    url = redis_test_url()
    parsed = urlparse(url)
    db = (parsed.path or "/0").lstrip("/") or "0"
    if db == "0" and parsed.scheme in ("redis", "rediss"):
        # Other engineers' tests share db 0 of this Redis with their own key prefixes: never flush it.
        pytest.fail(f"HERMES_TEST_REDIS_URL must name a dedicated database index other than 0, got {url}")
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.ConnectionError as e:
        pytest.fail(f"the test Redis at {url} is not reachable: {e}")
    lock_path = (
        Path(tempfile.gettempdir()) / f"hermes-test-redis-{hashlib.sha1(url.encode()).hexdigest()[:12]}.lock"
    )
    with open(lock_path, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            client.flushdb()
            client.close()
            yield url
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def conn(redis_url: str) -> Iterator[redis.Redis]:
    """A client on the (flushed) test database."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def fake() -> fakeredis.FakeRedis:
    """An in-memory Redis with Lua (fakeredis[lua]) for fast unit tests."""
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


# -- what a caller hears -----------------------------------------------------------------------

_HEARD: dict[int, Any] = {}


class Heard:
    """Every event published on ``channel``, kept per call, heard as the caller hears them.

    An ended call's history is its terminal event alone (TRANSITION trims it), so a test that checks the
    whole way a call went listens on its caller's channel. ``heard(conn)`` subscribes once per client:
    call it before the events are published (the unit tests' submit helpers do).
    """

    def __init__(self, conn: Any, channel: str) -> None:
        self.conn = conn
        self.pubsub = conn.pubsub()
        self.pubsub.subscribe(channel)
        self.calls: dict[str, list[Any]] = {}

    def events(self, call_id: str) -> list[Any]:
        from broker import events

        while (msg := self.pubsub.get_message(timeout=0.01)) is not None:
            if msg["type"] == "message":
                ev = events.decode(msg["data"])
                self.calls.setdefault(ev.call_id, []).append(ev)
        return list(self.calls.get(call_id, []))


def heard(conn: Any, channel: str = "hermes:ch:t") -> Heard:
    """The ``Heard`` of ``conn`` on ``channel`` (made and subscribed on first use)."""
    key = id(conn)
    found = _HEARD.get(key)
    if found is None or found.conn is not conn:
        found = _HEARD[key] = Heard(conn, channel)
    return found


@pytest.fixture
def keep_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HERMES_KEEP_HISTORY=1`` for this process and the workers and clients it starts: ended calls keep
    every event, for tests that check the whole way calls went from Redis (by default an ended call keeps
    its terminal event alone). Ask for it before ``gateway`` and ``workers``."""
    monkeypatch.setenv("HERMES_KEEP_HISTORY", "1")


# -- HERMES_HOME -------------------------------------------------------------------------------


@dataclass
class Home:
    """A temporary HERMES_HOME with a ``tools/`` directory and helpers to write specs and config."""

    path: Path

    @property
    def tools_dir(self) -> Path:
        return self.path / "tools"

    def tool(self, name: str, executor: str = "python", **fields: Any) -> dict[str, Any]:
        """Write ``tools/<name>.yaml``; returns the spec mapping written."""
        spec = {"name": name, "executor": executor, **fields}
        (self.tools_dir / f"{name}.yaml").write_text(
            yaml.safe_dump(spec, allow_unicode=True), encoding="utf-8"
        )
        return spec

    def echo_tool(self, name: str = "echo", **fields: Any) -> dict[str, Any]:
        """A python tool returning its arguments."""
        return self.tool(name, function=ECHO, **{"timeout": 10, "concurrency": HELPER_CONCURRENCY, **fields})

    def sleep_tool(self, name: str = "sleep", **fields: Any) -> dict[str, Any]:
        """A python tool sleeping ``seconds`` (cancellable)."""
        return self.tool(
            name,
            function=SLEEP,
            **{
                "timeout": 30,
                "concurrency": HELPER_CONCURRENCY,
                "input_schema": {"type": "object", "properties": {"seconds": {"type": "number"}}},
                **fields,
            },
        )

    def noop_tool(self, name: str = "noop", **fields: Any) -> dict[str, Any]:
        return self.tool(name, function=NOOP, **{"timeout": 10, "concurrency": HELPER_CONCURRENCY, **fields})

    def remove_tool(self, name: str) -> None:
        (self.tools_dir / f"{name}.yaml").unlink(missing_ok=True)

    def config(self, data: dict[str, Any]) -> Path:
        """Write ``config.yaml``."""
        path = self.path / "config.yaml"
        path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        return path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Home:
    """A fresh HERMES_HOME (also set in this process's environment)."""
    root = tmp_path / "hermes-home"
    (root / "tools").mkdir(parents=True)
    (root / "plugins").mkdir()
    monkeypatch.setenv("HERMES_HOME", str(root))
    for var in ("HERMES_LEASE", "HERMES_MAX_ATTEMPTS", "HERMES_RESULT_TTL", "HERMES_REDIS_URL"):
        monkeypatch.delenv(var, raising=False)
    return Home(root)


@pytest.fixture
def gateway(redis_url: str, home: Home) -> Iterator[Any]:
    """A Gateway client on the test database with ``home`` as HERMES_HOME (calls are not refused when no
    worker listens); closed afterwards."""
    from hermes_gateway.client import Gateway

    # Many tests submit before any worker runs (pending calls, queue limits): the client may not refuse them.
    gw = Gateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False)
    yield gw
    gw.close()


# -- real worker processes ---------------------------------------------------------------------


@dataclass
class WorkerProc:
    """One ``python -m workers`` process started by the ``workers`` fixture."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    name: str = ""
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the worker gets no chance to clean up (a crashed host)."""
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        """SIGTERM: a graceful stop (finish within the grace period, hand back the rest)."""
        self.signal(signal.SIGTERM)

    def wait(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""


def _heartbeat_name(client: redis.Redis, pid: int) -> str:
    # Worker names are hermes-<host>-<pid>-<hex>; the hash also records the pid.
    for raw in client.zrange("hermes:workers", 0, -1):
        name = raw.decode()
        parts = name.rsplit("-", 2)
        if len(parts) == 3 and parts[1] == str(pid):
            return name
    return ""


class WorkerFactory:
    """Starts worker processes; the fixture stops them (and shows their logs when the test failed)."""

    def __init__(self, redis_url: str, home: Home, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.home = home
        self.log_dir = log_dir
        self.started: list[WorkerProc] = []
        from broker.connection import from_url

        self._client = from_url(redis_url)

    def __call__(
        self,
        count: int = 1,
        *,
        queues: str | list[str] = "tools",
        concurrency: int = 16,
        lease: float = 2.0,
        grace: float = 5.0,
        env: dict[str, str] | None = None,
        wait: float = 20.0,
    ) -> list[WorkerProc]:
        """Start ``count`` workers and wait until each has sent its first heartbeat."""
        qs = queues if isinstance(queues, str) else ",".join(queues)
        child_env = dict(os.environ)
        child_env.update(
            {
                "HERMES_REDIS_URL": self.redis_url,
                "HERMES_HOME": str(self.home.path),
                "HERMES_LEASE": str(lease),
                "PYTHONUNBUFFERED": "1",
            }
        )
        child_env.update(env or {})
        argv = [
            sys.executable,
            "-m",
            "workers",
            "--queues",
            qs,
            "--concurrency",
            str(concurrency),
            "--grace",
            str(grace),
        ]
        # Count control-channel listeners before and after (the channel is scoped to the db index).
        listeners = self._listeners()
        batch = []
        for _ in range(count):
            log_path = self.log_dir / f"worker-{len(self.started)}.log"
            with open(log_path, "wb") as out:
                proc = subprocess.Popen(argv, env=child_env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
            w = WorkerProc(proc, log_path, args=argv)
            self.started.append(w)
            batch.append(w)
        deadline = time.monotonic() + wait
        for w in batch:
            while not w.name:
                w.name = _heartbeat_name(self._client, w.pid)
                if w.name:
                    break
                if not w.alive:
                    pytest.fail(
                        f"worker {w.pid} exited with {w.proc.returncode} before its first heartbeat:\n{w.log()}"
                    )
                if time.monotonic() > deadline:
                    pytest.fail(f"worker {w.pid} sent no heartbeat within {wait:g}s:\n{w.log()}")
                time.sleep(0.02)
        # The control thread subscribes just after the first heartbeat; a stop or cancel published
        # before that would be missed, so wait for it too (best effort: other runs may share the db).
        ready = time.monotonic() + 5
        while self._listeners() < listeners + count and time.monotonic() < ready:
            time.sleep(0.01)
        return batch

    def _listeners(self) -> int:
        from broker import keys
        from broker.connection import is_cluster

        channel = keys.channel(self._client, keys.CONTROL_CHANNEL)
        if is_cluster(self._client):  # PUBSUB NUMSUB counts one node's subscribers: ask every node (summed)
            reply = self._client.pubsub_numsub(channel, target_nodes=self._client.ALL_NODES)
        else:
            reply = self._client.pubsub_numsub(channel)
        return int(dict(reply).get(channel.encode(), 0))

    def stop_all(self, timeout: float = 10.0) -> None:
        for w in self.started:
            w.terminate()
        deadline = time.monotonic() + timeout
        for w in self.started:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(5)
        self._client.close()

    def dump_logs(self) -> None:
        for w in self.started:
            print(f"\n----- worker pid {w.pid} {w.name} exit={w.proc.returncode} log {w.log_path} -----")
            print(w.log()[-20_000:])


@pytest.fixture
def workers(
    request: pytest.FixtureRequest, redis_url: str, home: Home, tmp_path: Path
) -> Iterator[WorkerFactory]:
    """Factory: ``workers(count=1, queues="tools", concurrency=16, lease=2.0, grace=5.0, env=None)``.

    Starts real ``python -m workers`` processes on the test database with ``home`` as HERMES_HOME and
    ``HERMES_LEASE`` set; returns them once they heartbeat. All are stopped at teardown (SIGTERM,
    then SIGKILL); their output is printed when the test failed.
    """
    log_dir = tmp_path / "worker-logs"
    log_dir.mkdir()
    factory = WorkerFactory(redis_url, home, log_dir)
    yield factory
    factory.stop_all()
    if _failed(request.node):
        factory.dump_logs()


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """A test that configures logging (level filter, stream) must not leak it into the next one."""
    yield
    import structlog

    structlog.reset_defaults()
