"""A Redis restart in the middle of calls (its own redis-server with AOF, as in the compose stack):
the calls that finish while it is down keep their results (no second run), and ``result()`` rides out
the outage instead of raising a raw connection error."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.e2e.util import free_port

pytestmark = pytest.mark.e2e

REDIS = shutil.which("redis-server", path="/usr/local/bin:/usr/bin:/bin")
CLI = str(Path(sys.executable).parent / "hermes-gateway")


class Server:
    """redis-server with AOF in a directory of its own, which can be stopped and started again."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS is not None
        args = [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        conn = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                if conn.ping():
                    return
            except (redis.ConnectionError, redis.BusyLoadingError):
                assert time.monotonic() < deadline, "redis-server did not come up"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()  # SIGTERM: it writes its AOF and exits
            self.proc.wait(20)
            self.proc = None


def _outcome(handle: Any) -> tuple[str, Any]:
    try:
        return "ok", handle.result(60)
    except Exception as e:  # noqa: BLE001 - reported by the test
        return type(e).__name__, str(e)


async def _async_outcome(url: str, call_id: str) -> tuple[str, Any]:
    from hermes_gateway.aio import AsyncGateway

    async with await AsyncGateway.connect(url) as agw:
        handle = await agw.handle(call_id)
        try:
            return "ok", await handle.result(60)
        except Exception as e:  # noqa: BLE001 - reported by the test
            return type(e).__name__, str(e)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    if REDIS is None:
        pytest.skip("no redis-server binary here to restart")
    srv = Server(tmp_path)
    srv.start()
    yield srv
    srv.stop()


def test_calls_finishing_during_a_redis_restart_keep_their_results_and_run_once(
    server: Server, home: Any, tmp_path: Path
) -> None:
    from hermes_gateway import Gateway

    marks = tmp_path / "marks"
    marks.mkdir()
    home.tool(
        "mark",
        executor="command",
        command=[sys.executable, "-c", "import sys, time, tempfile; tempfile.mkstemp(prefix=sys.argv[1] + '.', dir=sys.argv[2]); time.sleep(2)", "{{id}}", str(marks)],
        timeout=60,
        input_schema={"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env.update(HERMES_REDIS_URL=server.url, HERMES_HOME=str(home.path))
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [CLI, "worker", "--queues", "tools", "-c", "8"], env=env, stdout=log, stderr=log
    )
    try:
        gw = Gateway.connect(server.url)
        gw.sync_tools(home.tools_dir)
        deadline = time.monotonic() + 30
        while not gw.live_workers("tools"):
            assert time.monotonic() < deadline and worker.poll() is None, (
                tmp_path / "worker.log"
            ).read_text()
            time.sleep(0.05)
        handles = gw.map("mark", [{"id": f"c{i}"} for i in range(4)])
        waited: list[Any] = []
        waiter = threading.Thread(target=lambda: waited.append(_outcome(handles[0])))
        waiter.start()  # waiting on a result across the outage
        awaited: list[Any] = []  # and the asyncio client (the HTTP API's), on another call
        async_waiter = threading.Thread(
            target=lambda: awaited.append(asyncio.run(_async_outcome(server.url, handles[1].call_id)))
        )
        async_waiter.start()
        time.sleep(0.8)  # all four running
        server.stop()
        time.sleep(6)  # they finish while Redis is down (longer than the outbox's first tries)
        server.start()
        waiter.join(60)
        async_waiter.join(60)
        assert waited and waited[0][0] == "ok", waited  # it rode out the outage: no raw ConnectionError
        assert awaited and awaited[0][0] == "ok", awaited
        results = [h.result(60) for h in handles]
        assert all(r == "" or r is None or isinstance(r, str) for r in results), results
        # Each ran once: its result was kept through the outage, not lost and run again.
        runs = sorted(p.name.split(".")[0] for p in marks.iterdir())
        assert runs == ["c0", "c1", "c2", "c3"], runs
        attempts = [gw.calls.record(h.call_id)["attempt"] for h in handles]
        assert attempts == [1, 1, 1, 1], attempts
        gw.close()
    finally:
        worker.terminate()
        worker.wait(30)
        log.close()
