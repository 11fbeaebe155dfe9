"""A broker password never leaves the process: /healthz, /v1/status, `status` and run files show the
broker URL with its password masked, whether it sits in the userinfo or in the query string.

A real password-protected redis-server, a real ``serve`` process, httpx over loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import REPO
from tests.e2e.util import free_port, wait_http

pytestmark = pytest.mark.e2e

PASSWORD = "Sup3rSecretPw"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A redis-server of its own that wants a password (stopped by its pid afterwards)."""
    port = free_port()
    workdir = tmp_path_factory.mktemp("locked-redis")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
         "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, password=PASSWORD).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "the password-protected redis-server did not start"
            time.sleep(0.05)
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def _run_files(home: Path) -> str:
    return "".join(p.read_text() for p in (home / "run").glob("*.json"))


@pytest.mark.parametrize("form", ["query", "userinfo"])
def test_the_broker_password_is_masked_in_healthz_status_and_run_files(
    locked_redis: int, home: Any, form: str
) -> None:
    url = (
        f"redis://127.0.0.1:{locked_redis}/0?password={PASSWORD}"
        if form == "query"
        else f"redis://default:{PASSWORD}@127.0.0.1:{locked_redis}/0"
    )
    env = dict(os.environ, HERMES_REDIS_URL=url, HERMES_HOME=str(home.path))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from hermes_gateway.cli import main; main()", "serve", "--port", str(port)],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        health = wait_http(f"http://127.0.0.1:{port}/healthz", proc)
        assert health.status_code == 200, health.text
        assert PASSWORD not in health.text and "***" in health.json()["broker"]
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=30)
        assert status.status_code == 200 and PASSWORD not in status.text
        assert "***" in status.json()["broker"]
        files = _run_files(home.path)
        assert files and PASSWORD not in files and "***" in files
        # /healthz answers loopback host names only, as every other route does without a token.
        rebound = httpx.get(f"http://127.0.0.1:{port}/healthz", headers={"Host": "evil.example"}, timeout=10)
        assert rebound.status_code == 403 and rebound.json()["error"]["type"] == "forbidden"
        foreign = httpx.get(
            f"http://127.0.0.1:{port}/healthz", headers={"Origin": "http://evil.example"}, timeout=10
        )
        assert foreign.status_code == 403
    finally:
        proc.terminate()
        proc.wait(20)
    cli = [sys.executable, "-c", "from hermes_gateway.cli import main; main()"]
    for args in (["status"], ["status", "--json"]):
        out = subprocess.run([*cli, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert PASSWORD not in out.stdout + out.stderr and "***" in out.stdout
        if "--json" in args:
            assert "***" in json.loads(out.stdout)["broker"]
