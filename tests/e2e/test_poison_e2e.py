"""Hostile data in Redis, end to end (issue 24.3): a poisoned job hash among good calls, malformed
pub/sub messages on a caller's channel, an undecodable tool directory entry. Each bad record is skipped,
logged and settled alone; everything else goes on. Real Redis, real worker processes, a real HTTP server.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import msgpack
import pytest
import redis

from broker import keys
from hermes_gateway.aio import AsyncGateway
from hermes_gateway.aio_handle import AsyncCallHandle
from hermes_gateway.handle import CallHandle
from tests.conftest import wait_until
from tests.e2e.test_http_api import Served
from tests.e2e.util import all_terminal, current, error_type

pytestmark = pytest.mark.e2e

# Messages an attacker (or a broken tool) with PUBLISH access could send on a caller's channel.
MALFORMED = [
    b"\xc1not msgpack",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"call_id": [1, 2], "seq": 1}),  # an unhashable call id
    msgpack.packb({"call_id": {"a": 1}, "seq": 1}),
    msgpack.packb({"call_id": "x", "seq": "not a number"}),
    msgpack.packb({"call_id": "x", "seq": {"a": 1}}),
    msgpack.packb({"call_id": "x", "seq": 1, "ts": "yesterday"}),
    msgpack.packb({"call_id": "x", "seq": 1, "ts": float("nan"), "state": ["done"]}),
    msgpack.packb({"call_id": "x", "seq": 1, "attempt": [1]}),
    msgpack.packb({"call_id": "x", "seq": 1, "detail": [1, 2]}),
    msgpack.packb({"call_id": "x", "seq": 2**63}),
    b"",
]


def test_one_poisoned_job_hash_leaves_no_good_call_pending(gateway: Any, home: Any, workers: Any, conn: redis.Redis) -> None:
    home.echo_tool()
    gateway.sync_tools()
    handles = [gateway.call_tool("echo", {"i": i}) for i in range(21)]
    poisoned = handles[7].call_id
    conn.hset(keys.job(poisoned), keys.F_ATTEMPT, "not-a-number")
    started = time.monotonic()
    workers(1, concurrency=8)
    ids = [h.call_id for h in handles]
    deadline = time.monotonic() + 60
    while not all_terminal(conn, ids):
        assert time.monotonic() < deadline, f"calls left unsettled: {current(conn, ids)}"
        time.sleep(0.05)
    settled = time.monotonic() - started
    states = current(conn, ids)
    assert states.pop(poisoned) == "failed" and error_type(conn, poisoned) == "bad_payload"
    assert set(states.values()) == {"done"}
    assert [h.result(timeout=10) for h in handles if h.call_id != poisoned] == [
        {"i": i} for i in range(21) if i != 7
    ]
    print(f"\n20 good calls + 1 poisoned settled {settled:.2f}s after the worker was started")


def _latencies(gateway: Any, n: int = 20) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        assert gateway.call_tool("echo", {"i": i}).result(timeout=20) == {"i": i}
        out.append(time.perf_counter() - t)
    return out


def test_malformed_messages_do_not_stop_the_sync_clients_event_thread(
    gateway: Any, home: Any, workers: Any, conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    workers(1)
    before = _latencies(gateway)
    polled: list[str] = []
    real_sync = CallHandle.sync

    def counting_sync(self: CallHandle) -> None:
        polled.append(self.call_id)
        real_sync(self)

    monkeypatch.setattr(CallHandle, "sync", counting_sync)
    for data in MALFORMED:
        conn.publish(gateway.channel, data)
    # Delivered: a call submitted after them is answered over pub/sub, by the same event thread.
    after = _latencies(gateway)
    assert gateway._thread.is_alive()
    assert polled == [], "results came from polling the history: the event thread stopped"
    print(
        f"\nsync client wait latency, median of 20: before {statistics.median(before) * 1000:.1f} ms, "
        f"after {len(MALFORMED)} malformed messages {statistics.median(after) * 1000:.1f} ms"
    )


def test_malformed_messages_do_not_end_the_async_clients_event_task(
    gateway: Any, home: Any, workers: Any, conn: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    workers(1)
    polled: list[str] = []
    real_sync = AsyncCallHandle.sync

    async def counting_sync(self: AsyncCallHandle) -> None:
        polled.append(self.call_id)
        await real_sync(self)

    async def main() -> list[float]:
        agw = await AsyncGateway.connect(redis_url, home=str(home.path), embedded_ok=False)
        try:
            await (await agw.call_tool("echo", {"warm": 1})).result(timeout=20)
            monkeypatch.setattr(AsyncCallHandle, "sync", counting_sync)
            for data in MALFORMED:
                await agw.conn.publish(agw.channel, data)
            out = []
            for i in range(20):
                t = time.perf_counter()
                assert await (await agw.call_tool("echo", {"i": i})).result(timeout=20) == {"i": i}
                out.append(time.perf_counter() - t)
            assert agw._task is not None and not agw._task.done()
            return out
        finally:
            await agw.close()

    latencies = asyncio.run(main())
    assert polled == [], "results came from polling the history: the event task ended"
    print(f"\nasync client wait latency after malformed messages, median {statistics.median(latencies) * 1000:.1f} ms")


def test_malformed_messages_do_not_end_the_http_apis_event_task(
    gateway: Any, home: Any, workers: Any, conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    workers(1)
    served = Served(gateway)
    polled: list[str] = []
    real_sync = AsyncCallHandle.sync

    async def counting_sync(self: AsyncCallHandle) -> None:
        polled.append(self.call_id)
        await real_sync(self)

    try:
        with httpx.Client(base_url=served.base, timeout=30) as api:
            assert api.post("/v1/tools/echo/calls", json={"args": {}, "wait": 20}).json()["state"] == "done"
            monkeypatch.setattr(AsyncCallHandle, "sync", counting_sync)
            # Every caller channel subscribed on this server: the API's own among them.
            channels = [c.decode() for c in conn.pubsub_channels(keys.caller_channel("*"))]
            assert len(channels) >= 2  # this test's Gateway and the API's AsyncGateway
            for channel in channels:
                for data in MALFORMED:
                    conn.publish(channel, data)
            latencies = []
            for i in range(20):
                t = time.perf_counter()
                out = api.post("/v1/tools/echo/calls", json={"args": {"i": i}, "wait": 20}).json()
                latencies.append(time.perf_counter() - t)
                assert out["state"] == "done" and out["result"] == {"i": i}
    finally:
        served.stop()
    assert polled == [], "the API waited by polling the history: its event task ended"
    print(f"\nHTTP wait latency after malformed messages, median {statistics.median(latencies) * 1000:.1f} ms")


def test_an_undecodable_directory_entry_is_skipped_with_one_warning(
    gateway: Any, home: Any, conn: redis.Redis, redis_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    home.echo_tool()
    home.noop_tool()
    gateway.sync_tools()
    conn.hset(keys.TOOLS, "broken", b"\xc1\xc1 not msgpack")
    conn.hset(keys.TOOLS, "not_a_spec", msgpack.packb({"executor": 5}))
    conn.hset(keys.TOOLS + ":ver", "noop", b"v-two")  # a version that is not a number
    # The Python client: listing and the model-facing schemas skip them.
    assert [e.spec.name for e in gateway.tools()] == ["echo"]
    assert [s["function"]["name"] for s in gateway.tool_schemas()] == ["echo"]
    gateway.tools()
    err = capfd.readouterr()
    text = err.out + err.err
    for name in ("broken", "not_a_spec", "noop"):
        assert text.count(f"tool={name}") == 1 or text.count(f"'tool': '{name}'") == 1 or text.count(f'"tool": "{name}"') == 1, text

    # The CLI.
    env = {"HERMES_REDIS_URL": redis_url, "HERMES_HOME": str(home.path), "PATH": "/usr/bin:/bin"}
    cli = [sys.executable, "-c", "from hermes_gateway.cli import main; main()", "tool", "list"]
    from tests.conftest import REPO

    listed = subprocess.run(cli, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "echo" in listed.stdout and "broken" in listed.stderr
    as_json = subprocess.run([*cli, "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    assert [row["name"] for row in json.loads(as_json.stdout)] == ["echo"]

    # The HTTP API.
    served = Served(gateway)
    try:
        with httpx.Client(base_url=served.base, timeout=30) as api:
            tools = api.get("/v1/tools")
            assert tools.status_code == 200 and [t["name"] for t in tools.json()] == ["echo"]
            schemas = api.get("/v1/schemas")
            assert schemas.status_code == 200 and [s["function"]["name"] for s in schemas.json()] == ["echo"]
    finally:
        served.stop()


def test_a_record_without_h_queue_is_failed_and_its_lease_goes(
    gateway: Any, home: Any, workers: Any, conn: redis.Redis
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    call_id = "{tools}.f00d" + "0" * 28
    conn.hset(keys.job(call_id), mapping={keys.F_STATE: "pending", keys.F_ATTEMPT: 1, "data": "garbage"})
    conn.lpush(keys.queue("tools"), call_id)
    workers(1, lease=1.0)
    wait_until(lambda: current(conn, [call_id])[call_id] == "failed", 20, message="the bad record failed")
    assert error_type(conn, call_id) == "bad_payload"
    # The queue is the id's tag's: the lease leaves hermes:leases:{tools}, and the reaper (every lease)
    # does not take it back.
    wait_until(lambda: conn.zscore(keys.leases("{tools}"), call_id) is None, 10, message="the lease went")
    assert conn.zcard(keys.leases("{}")) == 0
    assert gateway.call_tool("echo", {"after": 1}).result(timeout=20) == {"after": 1}

    # An expired lease of such a record (its worker gone) is the reaper's: it goes too.
    orphan = "{tools}.f00e" + "0" * 28
    conn.hset(keys.job(orphan), mapping={keys.F_STATE: "failed", keys.F_ATTEMPT: 1})
    conn.zadd(keys.leases("{tools}"), {orphan: 1})
    wait_until(lambda: conn.zscore(keys.leases("{tools}"), orphan) is None, 15, message="the reaper dropped it")
    # The reaper has run since: the first lease was not taken back either.
    assert conn.zscore(keys.leases("{tools}"), call_id) is None and conn.zcard(keys.leases("{}")) == 0


GARBAGE_IDS = [b"\xff\xfe raw bytes", b"not-a-call-id", b"", b"{other}.1234", ("{tools}.beef" + "0" * 28).encode()]


def test_garbage_ids_on_a_queue_are_drained_with_one_warning_each(
    gateway: Any, home: Any, workers: Any, conn: redis.Redis
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    conn.rpush(keys.queue("tools"), *GARBAGE_IDS)
    (worker,) = workers(1)
    assert gateway.call_tool("echo", {"after": 1}).result(timeout=20) == {"after": 1}  # queued behind them
    wait_until(lambda: conn.llen(keys.queue("tools")) == 0, 10, message="the queue drained")
    wait_until(lambda: worker.log().count("dropped an id on queue") >= len(GARBAGE_IDS), 10, message=worker.log())
    lines = [line for line in worker.log().splitlines() if "dropped an id on queue" in line]
    assert len(lines) == len(GARBAGE_IDS), lines
    assert all("queue=tools" in line and "warning" in line for line in lines), lines
    for raw, line in zip(GARBAGE_IDS, lines, strict=True):  # in the order they were queued, each named
        shown = raw.decode(errors="replace")
        assert f"call_id={shown} " in line + " " or f"call_id={shown!r}" in line, line  # (quoted when it has spaces)
    assert "Traceback" not in worker.log()


def test_a_queued_call_whose_record_was_deleted_by_hand_gives_its_slot_back(
    gateway: Any, home: Any, workers: Any, conn: redis.Redis
) -> None:
    # Limit 1: the first call holds the slot while queued, the second waits for it. The first's record
    # goes behind the gateway's back; the worker drops its id, and the slot it held goes to the second.
    home.echo_tool(concurrency=1)
    gateway.sync_tools()
    lost = gateway.call_tool("echo", {"n": 1})
    second = gateway.call_tool("echo", {"n": 2})
    tag = keys.tag("tools")
    slots = keys.slots(tag, "tool:echo")
    assert conn.zrange(slots, 0, -1) == [lost.call_id.encode()] and conn.zcard(keys.waiting(tag, "tool:echo")) == 1
    conn.delete(keys.job(lost.call_id))
    (worker,) = workers(1, lease=1.0)
    assert second.result(timeout=20) == {"n": 2}
    assert "dropped an id on queue" in worker.log()
    wait_until(lambda: conn.zcard(slots) == 0, 10, message="no slot left taken")
