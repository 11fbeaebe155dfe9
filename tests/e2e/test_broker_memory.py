"""Bounded memory on a real redis-server of our own with a small ``maxmemory``: what an ended call keeps,
``BrokerFull`` at maxmemory (Python client, HTTP, CLI), accepted calls ending anyway, the 80 % warning."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from broker import events, keys
from broker.audit import AuditLog
from hermes_gateway import BrokerFull, CallFailed  # (the names the docs give callers)
from hermes_gateway.client import Gateway
from tests.conftest import Home, WorkerFactory, wait_until
from tests.e2e.test_http_api import Served
from tests.redis_stack import data_node
from tests.workers.executors.http_server import Recorder

pytestmark = pytest.mark.e2e

MAXMEMORY = 4 * 1024 * 1024
BUDGET = 800  # bytes of Redis memory an ended call's own keys may take (issue 29)
NAP = "tests.e2e.stoptools:nap"


@pytest.fixture
def small_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server on a free port with maxmemory 4 MB (noeviction, as a broker must be)."""
    node = data_node(
        tmp_path, "small", ["--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction"]
    ).start()
    try:
        yield f"redis://127.0.0.1:{node.port}/0"
    finally:
        node.stop()


@pytest.fixture
def stack(small_redis: str, home: Home, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    home.echo_tool()
    home.noop_tool()
    home.tool("nap", function=NAP, timeout=30, concurrency=4)
    gw = Gateway.connect(small_redis, home=str(home.path), embedded_ok=False, check_workers=False)
    gw.sync_tools()
    log_dir = tmp_path / "worker-logs"
    log_dir.mkdir()
    factory = WorkerFactory(small_redis, home, log_dir)
    factory(1, concurrency=8)
    yield gw
    gw.close()
    factory.stop_all()
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        factory.dump_logs()


def _fill(conn: redis.Redis) -> int:
    """Write filler keys until Redis refuses one at maxmemory; returns how many went in."""
    n = 0
    while True:
        try:
            conn.set(f"filler:{n}", b"x" * 32 * 1024)
        except redis.exceptions.OutOfMemoryError:
            return n
        n += 1
        assert n < 1000, "maxmemory never reached"


def _runs(path: Path) -> int:
    log = Path(f"{path}.log")
    return log.read_text().count("start\n") if log.exists() else 0


def test_an_ended_calls_own_keys_take_at_most_800_bytes(stack: Any) -> None:
    conn = stack.conn
    # A typical call: 100 bytes of arguments, a small result (none: the done event carries the result,
    # so a bigger one adds its packed size, up to the 64 KiB an event carries).
    for h in [stack.call_tool("noop", {"text": "x" * 100, "n": 1}) for _ in range(3)]:
        h.result(timeout=20)
        job, end = keys.job(h.call_id), keys.ended(h.call_id)
        used = conn.memory_usage(job, samples=0) + conn.memory_usage(end, samples=0)
        assert used <= BUDGET, f"an ended call keeps {used} bytes ({conn.hkeys(job)})"
        assert conn.object("encoding", job) == b"listpack"  # small values only: no hash table
        assert not conn.exists(keys.history(h.call_id)) and conn.type(end) == b"string"  # its terminal event
        assert 0 < conn.ttl(job) <= 3600 and 0 < conn.ttl(end) <= 3600  # the default workers.result_ttl
        rec = stack.calls.record(h.call_id)
        assert (rec["state"], rec["result"], rec["seq"]) == ("done", None, 5)
        assert rec["ended_at"] and rec["trace_id"]
        (kept,) = events.history(conn, h.call_id)  # what is stored: the terminal event alone
        assert kept.state == "done"
        # Its earlier moves ride on it (the console's waterfall of an ended call; a handle's events()
        # rebuilds them): state, attempt, and how many µs before the end each happened, in order.
        rebuilt = list(stack.handle(h.call_id).events(timeout=5))
        assert [(e.state, e.seq) for e in rebuilt] == [("pending", 1), ("routing", 2), ("executing", 3), ("formatting", 4), ("done", 5)]
        steps = kept.steps
        assert [(s[0], s[1]) for s in steps] == [(st, 1) for st in ("pending", "routing", "executing", "formatting")]
        befores = [s[2] for s in steps]
        assert befores == sorted(befores, reverse=True) and befores[-1] >= 0


def test_at_maxmemory_a_submission_is_broker_full_and_accepted_calls_still_end(
    stack: Any, tmp_path: Path
) -> None:
    conn = stack.conn
    paths = [tmp_path / f"call{i}" for i in range(12)]
    # 12 calls of a tool limited to 4 at once: 4 run, 8 wait for a slot (promoted as others end).
    handles = [stack.call_tool("nap", {"seconds": 0.3, "path": str(p)}) for p in paths]
    assert _fill(conn) > 0
    # Hold Redis past maxmemory whatever the ending calls free meanwhile (a few KB each).
    conn.config_set("maxmemory", max(1, int(conn.info("memory")["used_memory"]) - 256 * 1024))

    with pytest.raises(BrokerFull) as refused:
        stack.call_tool("echo", {"x": 1})
    assert refused.value.type == "broker_full"
    assert "Redis is out of memory: maxmemory" in refused.value.message
    batch = stack.map("echo", [{"i": 1}, {"i": 2}])
    assert [type(h.refused) for h in batch] == [BrokerFull, BrokerFull]

    # Every accepted call ends, each run exactly once, while Redis stays past maxmemory.
    audit = AuditLog(conn)
    for h, p in zip(handles, paths, strict=True):
        assert h.result(timeout=30) == {"slept": 0.3}
        assert _runs(p) == 1
        # Its audit record too: the worker sends it in the pipeline of the end (just after the event).
        audited = wait_until(lambda h=h: audit.get(h.call_id), 5, message="the audit record")
        assert audited.state == "done"
    assert int(conn.info("memory")["used_memory"]) > int(conn.config_get("maxmemory")["maxmemory"])
    with pytest.raises(BrokerFull):
        stack.call_tool("echo", {"x": 1})

    # Room again: calls are taken as before.
    conn.config_set("maxmemory", 0)
    assert stack.call_tool("echo", {"x": 2}).result(timeout=20) == {"x": 2}


def test_at_maxmemory_a_rate_limited_tool_answered_429_ends_with_its_error(
    small_redis: str, home: Home, tmp_path: Path
) -> None:
    # The 429 pauses the tool's key, a write Redis refuses at maxmemory: the call ends all the same, with the
    # back end's answer, run once (the refusal escaped the worker's call thread: the call ran again each lease).
    home.config({"executors": {"http": {"allow_networks": ["127.0.0.1/32"]}}})
    backend, gw = Recorder(), Gateway.connect(small_redis, home=str(home.path), embedded_ok=False, check_workers=False)
    factory = WorkerFactory(small_redis, home, tmp_path)
    try:
        endpoint = f"{backend.base}/status/429?after=1"  # (time to fill Redis while the request is out)
        limit = {"requests_per_second": 10}
        gw.register_tool({"name": "hits", "executor": "http", "endpoint": endpoint, "rate_limit": limit})
        factory(1)
        handle = gw.call_tool("hits", {})
        wait_until(lambda: backend.received, message="the request")
        _fill(gw.conn)
        gw.conn.config_set("maxmemory", max(1, int(gw.conn.info("memory")["used_memory"]) - 256 * 1024))
        with pytest.raises(CallFailed) as failed:
            handle.result(timeout=20)
        assert failed.value.type == "executor_error" and "HTTP 429" in failed.value.message
        assert len(backend.received) == 1
    finally:
        gw.close()
        factory.stop_all()
        backend.close()


def test_at_maxmemory_http_answers_503_broker_full_and_the_cli_says_so(
    stack: Any, small_redis: str, home: Home
) -> None:
    conn = stack.conn
    served = Served(stack)
    try:
        with httpx.Client(base_url=served.base, timeout=30) as client:
            ok = client.post("/v1/tools/echo/calls", json={"args": {"x": 1}, "wait": 20})
            assert ok.status_code == 200 and ok.json()["result"] == {"x": 1}
            _fill(conn)
            conn.config_set("maxmemory", max(1, int(conn.info("memory")["used_memory"]) - 256 * 1024))
            full = client.post("/v1/tools/echo/calls", json={"args": {"x": 2}})
            assert full.status_code == 503, full.text
            error = full.json()["error"]
            assert error["type"] == "broker_full" and "Redis is out of memory: maxmemory" in error["message"]
            status = client.get("/v1/status").json()
            assert status["memory"]["fraction"] > 1 and "maxmemory" in status["memory"]["warning"]
    finally:
        served.stop()
    env = {"HERMES_REDIS_URL": small_redis, "HERMES_HOME": str(home.path), "PATH": "/usr/bin:/bin"}
    cli = str(Path(sys.executable).parent / "hermes-gateway")
    out = subprocess.run([cli, "tool", "run", "echo", '{"x": 3}'], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "broker_full" in out.stderr and "Redis is out of memory" in out.stderr


def test_status_and_the_console_warn_past_80_percent_of_maxmemory(
    stack: Any, small_redis: str, home: Home
) -> None:
    from hermes_gateway.console_data import snapshot

    conn = stack.conn
    env = {"HERMES_REDIS_URL": small_redis, "HERMES_HOME": str(home.path), "PATH": "/usr/bin:/bin"}
    cli = str(Path(sys.executable).parent / "hermes-gateway")

    def status() -> tuple[str, dict[str, Any]]:
        text = subprocess.run([cli, "status"], env=env, capture_output=True, text=True, timeout=60)
        doc = subprocess.run([cli, "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert text.returncode == 0 and doc.returncode == 0, text.stderr + doc.stderr
        return text.stdout, json.loads(doc.stdout)["memory"]

    text, mem = status()
    assert mem["maxmemory"] == MAXMEMORY and mem["fraction"] < 0.8 and mem["warning"] is None
    assert "warning" not in text and "of 4.0 MiB (maxmemory)" in text
    assert snapshot(stack)["memory"]["warning"] is None

    n = 0
    while int(conn.info("memory")["used_memory"]) < MAXMEMORY * 0.85:  # past 80 %, short of 100 %
        conn.set(f"filler:{n}", b"x" * 32 * 1024)
        n += 1
    text, mem = status()
    assert 0.8 <= mem["fraction"] < 1 and "maxmemory" in mem["warning"]
    assert "warning" in text and "of maxmemory" in text
    assert "of maxmemory" in snapshot(stack)["memory"]["warning"]
    assert stack.call_tool("echo", {"x": 1}).result(timeout=20) == {"x": 1}  # a warning, not a refusal


def test_at_maxmemory_a_rate_limited_models_retry_ends_the_call_with_the_providers_error(
    small_redis: str, home: Home, tmp_path: Path
) -> None:
    # A 500 the worker would retry: the retry's limiter entry is a write Redis refuses at maxmemory, so the
    # call ends with the provider's error (it was internal_error: OutOfMemoryError), after one request.
    from tests.llm_server import LLMServer, Reply

    with LLMServer() as llm:
        llm.rule = lambda body: Reply(status=500, error="overloaded", delay=1.0)  # (time to fill Redis)
        home.config({"model": {"provider": "openai-compatible", "base_url": llm.base_url, "api_key": "sk-test",
                               "model": "m", "max_retries": 2, "rate_limits": {"m": {"requests_per_second": 5}}}})
        gw = Gateway.connect(small_redis, home=str(home.path), embedded_ok=False, check_workers=False)
        factory = WorkerFactory(small_redis, home, tmp_path)
        try:
            factory(1, queues="llm")
            handle = gw.call_llm({"messages": [{"role": "user", "content": "hi"}]})
            wait_until(lambda: llm.chat_requests, message="the request")
            _fill(gw.conn)
            gw.conn.config_set("maxmemory", max(1, int(gw.conn.info("memory")["used_memory"]) - 256 * 1024))
            with pytest.raises(CallFailed) as failed:
                handle.result(timeout=20)
            assert failed.value.type == "provider_error" and "500" in failed.value.message, failed.value
            assert len(llm.chat_requests) == 1
        finally:
            gw.close()
            factory.stop_all()
