"""The README's Redis ACL users per role (examples/redis-users.acl) on a real redis-server: a worker and a
client run and cancel calls under their own users, and neither can write the directory or the policy."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker import keys
from broker.embedded import find_redis_server
from broker.errors import CallCancelled
from hermes_gateway.client import Gateway
from tests.conftest import REPO, Home, WorkerFactory, wait_until
from tests.e2e.util import free_port
from workers import policy_store
from workers.policy import Policy

pytestmark = pytest.mark.e2e

ACL = REPO / "examples" / "redis-users.acl"


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own with the example users; its URL template (``{user}``)."""
    port = free_port()
    binary, _ = find_redis_server()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--aclfile", str(ACL), "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://{{user}}:change-me-{{user}}@127.0.0.1:{port}/3"
    admin = redis.Redis.from_url(url.format(user="admin"))
    wait_until(lambda: _pings(admin), 10, message="the ACL redis-server")
    yield url
    admin.close()
    proc.terminate()
    proc.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_workers_and_clients_work_under_their_users_and_cannot_change_directory_or_policy(
    acl_redis: str, home: Home, tmp_path: Path
) -> None:
    admin = Gateway.connect(acl_redis.format(user="admin"), home=str(home.path), embedded_ok=False)
    admin.register_tool({"name": "echo", "executor": "python", "function": "workers.executors.builtin:echo", "timeout": 10})
    admin.register_tool({"name": "sleep", "executor": "python", "function": "workers.executors.builtin:sleep", "timeout": 30})
    policy_store.push(admin.conn, Policy.from_dict({"principals": {"ops": {"grants": ["*"]}}}), source="test")
    logs = tmp_path / "worker-logs"
    logs.mkdir()
    workers = WorkerFactory(acl_redis.format(user="admin"), home, logs)
    client = Gateway.connect(acl_redis.format(user="client"), home=str(home.path), embedded_ok=False)
    try:
        workers(1, env={"HERMES_REDIS_URL": acl_redis.format(user="worker")})
        assert client.call_tool("echo", {"a": 1}, principal="ops", idempotency_key="k").result(20) == {"a": 1}
        assert [s["function"]["name"] for s in client.tool_schemas("ops")] == ["echo", "sleep"]
        running = client.call_tool("sleep", {"seconds": 20})
        wait_until(lambda: running.state == "executing", 15, message="the sleep running")
        assert running.cancel()
        with pytest.raises(CallCancelled):
            running.result(15)
        # A batch: the client writes its meta, the worker's TRANSITION its results (hermes:batch:*).
        job = client.batch("echo", [{"n": i} for i in range(5)])
        assert job.wait(30).counts == {"done": 5}
        assert sorted(item.result["n"] for item in job.results()) == list(range(5))

        for user in ("client", "worker"):
            conn = redis.Redis.from_url(acl_redis.format(user=user))
            with pytest.raises(redis.exceptions.NoPermissionError):
                conn.hset(keys.TOOLS, "evil", b"x")
            with pytest.raises(redis.exceptions.NoPermissionError):
                policy_store.push(conn, Policy.from_dict({"principals": {"*": {"grants": ["*"]}}}))
            with pytest.raises(redis.exceptions.NoPermissionError):
                conn.flushdb()
            conn.close()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.register_tool({"name": "evil", "executor": "python", "function": "workers.executors.builtin:echo"})
        assert [e.spec.name for e in admin.tools()] == ["echo", "sleep"]
        workers.stop_all()  # a clean stop under its user too (hands back, unregisters)
        log = "".join(w.log() for w in workers.started)
        assert "no permissions" not in log and "NOPERM" not in log and "worker stopped" in log, log
    finally:
        workers.stop_all()
        client.close()
        admin.close()


def test_commands_that_only_read_work_as_a_read_only_user_and_name_what_they_could_not_register(
    acl_redis: str, home: Home
) -> None:
    # (they registered $HERMES_HOME/tools first: the client user's write was NOPERM, and the command died with it)
    from tests.e2e.test_cli import _env, _run

    admin = Gateway.connect(acl_redis.format(user="admin"), home=str(home.path), embedded_ok=False)
    try:
        admin.register_tool({"name": "echo", "executor": "python", "function": "workers.executors.builtin:echo", "timeout": 10})
        home.echo_tool(timeout=99)  # $HERMES_HOME/tools: an older echo of this machine's, and a tool not registered
        home.noop_tool()
        before = [(e.spec.to_dict(), e.version) for e in admin.tools()]
        env = _env(home, HERMES_REDIS_URL=acl_redis.format(user="client"))
        explained = _run(["policy", "explain", "ops", "echo"], env)
        assert explained.returncode == 0, explained.stderr
        listed = _run(["tool", "list", "--json"], env)
        assert listed.returncode == 0, listed.stderr
        assert [t["name"] for t in json.loads(listed.stdout)] == ["echo"]
        assert "echo, noop: $HERMES_HOME/tools holds specs this broker user may not register" in listed.stderr
        shown = _run(["tool", "show", "echo"], env)
        assert shown.returncode == 0 and "timeout: 10" in shown.stdout, shown.stderr
        assert [(e.spec.to_dict(), e.version) for e in admin.tools()] == before
        # A user that may write registers them, as every command loads $HERMES_HOME/tools (README).
        listed = _run(["tool", "list", "--json"], _env(home, HERMES_REDIS_URL=acl_redis.format(user="admin")))
        assert listed.returncode == 0 and sorted(t["name"] for t in json.loads(listed.stdout)) == ["echo", "noop"]
    finally:
        admin.close()
