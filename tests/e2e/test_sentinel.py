"""Redis Sentinel end to end: a primary, its replica and three Sentinels (real redis-server processes on
free loopback ports, started and stopped by PID here), real worker processes, and every client on one
``redis+sentinel://`` URL. The primary is killed (-9) in the middle of a batch: with
``broker.wait_replicas: 1`` every accepted call still ends, none is stuck, and a call that ran twice says
so with ``attempt`` > 1. With no replica to confirm, a submission fails ``BrokerNotDurable`` and nothing of
it runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker import keys
from tests.conftest import REPO, Home
from tests.redis_stack import SentinelStack

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).parent / "hermes-gateway")
LEASE = 2.0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[SentinelStack]:
    with SentinelStack(tmp_path / "redis") as st:
        yield st


class Workers:
    """``python -m workers`` processes on the Sentinel URL, stopped by PID at the end."""

    def __init__(self, url: str, home: Home, log_dir: Path) -> None:
        self.url, self.home, self.log_dir = url, home, log_dir
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, count: int, concurrency: int = 8) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
        env.update(HERMES_REDIS_URL=self.url, HERMES_HOME=str(self.home.path), HERMES_LEASE=str(LEASE))
        env["PYTHONUNBUFFERED"] = "1"
        for _ in range(count):
            log = self.log_dir / f"worker-{len(self.procs)}.log"
            with open(log, "wb") as out:
                argv = [sys.executable, "-m", "workers", "--queues", "tools", "--concurrency", str(concurrency)]
                proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
            self.procs.append((proc, log))

    def logs(self) -> str:
        return "\n".join(f"--- worker {p.pid} ---\n{log.read_text(errors='replace')[-6000:]}" for p, log in self.procs)

    def stop(self) -> None:
        for p, _ in self.procs:
            if p.poll() is None:
                p.terminate()
        for p, _ in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture
def workers(stack: SentinelStack, home: Home, tmp_path: Path) -> Iterator[Workers]:
    ws = Workers(stack.url(1), home, tmp_path)
    yield ws
    ws.stop()


def _marking_tool(home: Home, marks: Path, seconds: float) -> None:
    """A command tool that leaves one file per run (``<id>.<random>``) and then sleeps."""
    home.tool(
        "mark",
        executor="command",
        command=[sys.executable, "-c", f"import sys, time, tempfile; tempfile.mkstemp(prefix=sys.argv[1] + '.', dir=sys.argv[2]); time.sleep({seconds})", "{{id}}", str(marks)],
        timeout=60,
        concurrency=1000,
        input_schema={"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
    )  # fmt: skip


def _wait_workers(gw: Any, count: int, workers: Workers) -> None:
    deadline = time.monotonic() + 30
    while len(gw.live_workers("tools")) < count:
        assert time.monotonic() < deadline, workers.logs()
        assert all(p.poll() is None for p, _ in workers.procs), workers.logs()
        time.sleep(0.05)


async def _async_result(url: str, home: Home, call_id: str, connected: threading.Event) -> tuple[str, Any]:
    from hermes_gateway.aio import AsyncGateway

    async with await AsyncGateway.connect(url, home=str(home.path), embedded_ok=False) as agw:
        handle = await agw.handle(call_id)
        connected.set()
        try:
            return "ok", await handle.result(120)
        except Exception as e:  # noqa: BLE001 - reported by the test
            return type(e).__name__, str(e)


def test_calls_go_through_a_sentinel_url_from_every_client_and_the_cli(
    stack: SentinelStack, home: Home, workers: Workers
) -> None:
    from hermes_gateway import Gateway
    from hermes_gateway.aio import AsyncGateway

    url = stack.url(1)
    home.echo_tool()
    workers.start(1)
    with Gateway.connect(url, home=str(home.path), embedded_ok=False) as gw:
        gw.sync_tools()
        _wait_workers(gw, 1, workers)
        assert gw.call_tool("echo", {"x": 1}).result(30) == {"x": 1}
        assert [h.result(30) for h in gw.map("echo", [{"i": i} for i in range(20)])] == [{"i": i} for i in range(20)]
        # The calls live in db 1 of the primary the Sentinels name.
        primary = redis.Redis(port=stack.master_port(), db=1)
        assert primary.llen(keys.queue("tools")) == 0 and primary.hlen(keys.TOOLS) == 1

    async def through_asyncio() -> Any:
        async with await AsyncGateway.connect(url, home=str(home.path), embedded_ok=False) as agw:
            return await (await agw.call_tool("echo", {"async": True})).result(30)

    assert asyncio.run(through_asyncio()) == {"async": True}

    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env.update(HERMES_REDIS_URL=url, HERMES_HOME=str(home.path))
    status = subprocess.run([CLI, "status"], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert f"broker: Redis at {url}" in status.stdout
    listed = subprocess.run([CLI, "tool", "list"], env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "echo" in listed.stdout, listed.stderr


def test_unreachable_sentinels_are_one_clear_line_from_the_cli(home: Home) -> None:
    from tests.e2e.util import free_port

    ports = [free_port(), free_port()]
    url = f"redis+sentinel://:pw0rd@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/mymaster/2?sentinel_password=s3nt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env.update(HERMES_REDIS_URL=url, HERMES_HOME=str(home.path))
    for argv in ([CLI, "status"], [CLI, "tool", "list"]):
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert "Traceback" not in out.stderr and "pw0rd" not in out.stderr and "s3nt" not in out.stderr
        assert f"redis+sentinel://:***@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/mymaster/2?sentinel_password=***" in lines[0]
        assert f"127.0.0.1:{ports[0]} did not answer" in lines[0]
    # An unknown master name says what the Sentinels do watch.
    with SentinelStack(home.path.parent / "redis-unknown") as st:
        wrong = st.url(0).replace("/mymaster/", "/othermaster/")
        env["HERMES_REDIS_URL"] = wrong
        out = subprocess.run([CLI, "status"], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "watches no primary named 'othermaster' (it watches: mymaster)" in out.stderr


def test_killing_the_primary_mid_batch_loses_no_accepted_call_and_reports_reruns(
    stack: SentinelStack, home: Home, workers: Workers, tmp_path: Path
) -> None:
    from hermes_gateway import Gateway

    url = stack.url(1)
    marks = tmp_path / "marks"
    marks.mkdir()
    _marking_tool(home, marks, 0.3)
    home.config({"broker": {"wait_replicas": 1, "wait_timeout_ms": 1000}})
    workers.start(2, concurrency=8)
    gw = Gateway.connect(url, home=str(home.path), embedded_ok=False)
    try:
        gw.sync_tools()
        _wait_workers(gw, 2, workers)
        batch = gw.map("mark", [{"id": f"c{i}"} for i in range(120)])
        assert not batch.refused  # every submission confirmed by the replica
        ids = {h.call_id: i for i, h in enumerate(batch)}
        # A caller waiting across the failover, on another thread.
        waited: list[Any] = []
        waiter = threading.Thread(target=lambda: waited.append(batch[-1].result(120)))
        waiter.start()
        awaited: list[Any] = []  # and one on the asyncio client (the HTTP API's), connected before the kill
        connected = threading.Event()
        async_waiter = threading.Thread(
            target=lambda: awaited.append(asyncio.run(_async_result(url, home, batch[-2].call_id, connected)))
        )
        async_waiter.start()
        assert connected.wait(30)
        deadline = time.monotonic() + 20
        while len(list(marks.iterdir())) < 10:  # mid-batch: some ran, most have not
            assert time.monotonic() < deadline, workers.logs()
            time.sleep(0.02)
        old = stack.master_port()
        stack.node(old).kill()
        killed = time.monotonic()
        stack.wait_failover(old)
        # Every accepted call ends, through result(), on the promoted replica.
        outcomes = []
        for h in batch:
            try:
                h.result(120)
                outcomes.append("done")
            except Exception as e:  # noqa: BLE001 - reported below
                outcomes.append(f"{type(e).__name__}: {e}")
        waiter.join(120)
        async_waiter.join(120)
        assert waited, "the waiting caller got no result"
        assert awaited and awaited[0] == ("ok", ""), awaited  # (the command tool prints nothing)
        assert outcomes == ["done"] * len(batch), [o for o in outcomes if o != "done"][:5]
        records = {cid: gw.calls.record(cid) for cid in ids}
        assert {cid for cid, rec in records.items() if rec is None} == set()  # none lost
        assert {rec["state"] for rec in records.values() if rec} == {"done"}  # none stuck
        new = redis.Redis(port=stack.master_port(), db=1)
        deadline = time.monotonic() + 3 * LEASE + 10
        while new.zcard(keys.LEASES):  # no lease left behind (a rerun's lease ends with it)
            assert time.monotonic() < deadline, new.zrange(keys.LEASES, 0, -1, withscores=True)
            time.sleep(0.1)
        # Each call ran at least once; one that ran more than once is reported as a later attempt.
        runs: dict[str, int] = {}
        for p in marks.iterdir():
            runs[p.name.split(".")[0]] = runs.get(p.name.split(".")[0], 0) + 1
        assert set(runs) == {f"c{i}" for i in range(120)}
        twice = {cid: records[cid]["attempt"] for cid, i in ids.items() if runs[f"c{i}"] > 1}
        assert all(attempt > 1 for attempt in twice.values()), twice
        print(f"failover: {time.monotonic() - killed:.1f}s to every result; reruns: {len(twice)}")
    finally:
        gw.close()


def test_without_a_replica_to_confirm_a_submission_is_broker_not_durable_and_never_runs(
    stack: SentinelStack, home: Home, workers: Workers, tmp_path: Path
) -> None:
    from hermes_gateway import BrokerNotDurable, Gateway
    from hermes_gateway.aio import AsyncGateway
    from hermes_gateway.http_guard import error_reply

    url = stack.url(1)
    marks = tmp_path / "marks"
    marks.mkdir()
    _marking_tool(home, marks, 0.0)
    home.config({"broker": {"wait_replicas": 1, "wait_timeout_ms": 200}})
    workers.start(1)
    gw = Gateway.connect(url, home=str(home.path), embedded_ok=False)
    try:
        gw.sync_tools()
        _wait_workers(gw, 1, workers)
        assert gw.call_tool("mark", {"id": "before"}).result(30) is not None  # confirmed while the replica is up
        stack.replica.stop()
        with pytest.raises(BrokerNotDurable) as info:
            gw.call_tool("mark", {"id": "single"})
        error = info.value
        assert error.details["replicas"] == 0 and error.details["wanted"] == 1 and error.details["cancelled"] is True
        # Cancelled at once while pending, or (a worker took it before the cancel) ended cancelled by it.
        deadline = time.monotonic() + 20
        while gw.calls.record(error.details["call_id"])["state"] != "cancelled":
            assert time.monotonic() < deadline, gw.calls.record(error.details["call_id"])
            time.sleep(0.05)
        batch = gw.map("mark", [{"id": f"m{i}"} for i in range(5)])
        assert len(batch.refused) == 5 and all(isinstance(h.refused, BrokerNotDurable) for _, h in batch.refused)
        job = gw.batch("mark", [{"id": f"b{i}"} for i in range(3)])  # a batch's submitter too (CLI, HTTP)
        with pytest.raises(BrokerNotDurable) as binfo:
            job.wait(30)
        assert binfo.value.details["batch_id"] == job.id and binfo.value.details["cancelled"] == 3

        async def through_asyncio() -> BrokerNotDurable:
            async with await AsyncGateway.connect(url, home=str(home.path), embedded_ok=False) as agw:
                with pytest.raises(BrokerNotDurable) as ainfo:
                    await agw.call_tool("mark", {"id": "async"})
                abatch = await agw.map("mark", [{"id": "a0"}, {"id": "a1"}])
                assert len(abatch.refused) == 2
                return ainfo.value

        aerror = asyncio.run(through_asyncio())
        assert aerror.details["cancelled"] is True
        assert error_reply(aerror).status_code == 503  # what the HTTP API answers
        time.sleep(3 * LEASE)  # a negative check, bounded: a worker that took any of them would have run it by now
        ran = sorted(p.name.split(".")[0] for p in marks.iterdir())
        assert ran == ["before"], ran
    finally:
        gw.close()
