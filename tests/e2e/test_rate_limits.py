"""Rate limits with real worker processes and the fake OpenAI-compatible server: what the provider
receives stays within the limit across workers, one 429 pauses the fleet, tokens are settled and
counted per principal, budgets and over-large estimates are refused with typed errors."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker import keys
from broker.audit import AuditLog
from broker.ratelimits import RateLimiter
from hermes_gateway import BudgetExceeded, TokensOverLimit  # (the names the docs give callers)
from tests.conftest import Home, wait_until
from tests.llm_server import LLMServer, Reply
from tests.workers.executors.http_server import Recorder

pytestmark = pytest.mark.e2e

MODEL = "hermes-test"
ASK = [{"role": "user", "content": "Say something"}]
CKEY = f"llm:{MODEL}"


def _config(
    home: Home, server: LLMServer, limit: dict[str, int], policy: dict[str, Any] | None = None, retries: int = 0,
    key: str = MODEL,
) -> None:
    home.config(
        {
            "model": {
                "provider": "openai-compatible",
                "base_url": server.base_url,
                "api_key": "sk-test",
                "model": MODEL,
                "max_retries": retries,
                "rate_limits": {key: limit},
            },
            "executors": {"llm": {"concurrency": 50}},
            **({"policy": policy} if policy else {}),
        }
    )


@pytest.fixture
def llm(home: Home) -> Iterator[LLMServer]:
    with LLMServer(api_key="sk-test", model=MODEL) as server:
        _config(home, server, {"requests_per_second": 5})
        yield server


def _most_in_window(times: list[float], window: float) -> int:
    times = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while times[lo] <= t - window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def test_the_provider_never_sees_more_than_the_limit_from_two_workers(llm: LLMServer, gateway: Any, workers: Any) -> None:
    workers(2, queues="llm")
    handles = [gateway.call_llm({"messages": ASK}) for _ in range(16)]
    for h in handles:
        assert h.result(30)["choices"][0]["message"]["content"]
    received = [r.received for r in llm.chat_requests]
    assert len(received) == 16  # each call sent once
    assert _most_in_window(received, 1.0) <= 5  # 5 per second, counted where the provider counts
    assert received[-1] - received[0] >= 2.0  # (16 calls at 5/s need three windows: they waited)


def test_a_provider_model_limit_holds_whatever_provider_name_the_caller_gives(
    home: Home, redis_url: str, workers: Any
) -> None:
    # The workers call model.provider whatever the call's context names (Hermes' plugin passes the agent's own
    # provider name, "custom" say): the limit of "openai-compatible/<model>" is the one its requests count on.
    from hermes_gateway.client import Gateway

    with LLMServer(api_key="sk-test", model=MODEL) as server:
        _config(home, server, {"requests_per_second": 5}, key=f"openai-compatible/{MODEL}")
        gw = Gateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False)
        try:
            workers(2, queues="llm")
            handles = [gw.call_llm({"messages": ASK}, provider="custom") for _ in range(12)]
            for h in handles:
                assert h.result(30)["choices"][0]["message"]["content"]
        finally:
            gw.close()
        received = [r.received for r in server.chat_requests]
    assert len(received) == 12 and _most_in_window(received, 1.0) <= 5


def test_one_429_pauses_the_fleet_and_the_refused_call_waits_instead_of_retrying(
    llm: LLMServer, gateway: Any, workers: Any
) -> None:
    workers(2, queues="llm")
    llm.script(Reply(status=429, error="slow down", headers={"Retry-After": "1.5"}))
    first = gateway.call_llm({"messages": ASK})
    limiter = RateLimiter(gateway.conn)
    row = wait_until(lambda: [r for r in limiter.snapshot(["llm"]) if r["paused_until"]], message="the pause")[0]
    until = row["paused_until"]
    rest = [gateway.call_llm({"messages": ASK}) for _ in range(4)]
    for h in [first, *rest]:
        assert h.result(30)["choices"][0]["message"]["content"]
    received = [r.received for r in llm.chat_requests]
    assert len(received) == 6  # the 429, then each call once: no retry burst
    assert sum(1 for t in received if t < until - 0.01) == 1  # nothing else reached it during the pause
    # The refused call went back to waiting (no attempt lost in its own retry loop): it ran again.
    evs = list(first.events(timeout=5))
    back = [e for e in evs if e.state == "retrying"]
    assert back and back[0].detail["reason"] == "rate_limited"


def test_tokens_are_settled_with_the_usage_and_counted_per_principal(
    home: Home, redis_url: str, workers: Any
) -> None:
    from hermes_gateway.client import Gateway

    with LLMServer(api_key="sk-test", model=MODEL) as server:
        _config(
            home, server, {"tokens_per_minute": 3000},
            policy={"principals": {"alice": {"daily_tokens": 3}}},
        )
        gw = Gateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False)
        try:
            with pytest.raises(TokensOverLimit) as over:
                gw.call_llm({"messages": ASK, "max_tokens": 5000})
            assert over.value.details["limit"] == 3000
            workers(1, queues="llm")
            # Each reserves ~1,000 (max_tokens 1,000 + the prompt) and uses a few: all run within the
            # minute, which three reservations alone would not allow without the settle-back.
            handles = [gw.call_llm({"messages": ASK, "max_tokens": 1000}, principal="bob") for _ in range(5)]
            for h in handles:
                h.result(20)
            h = gw.call_llm({"messages": ASK}, principal="alice")
            h.result(20)
            with pytest.raises(BudgetExceeded):  # alice's 3 tokens a day are spent by one call
                gw.call_llm({"messages": ASK}, principal="alice").result(20)
            record = AuditLog(gw.conn).get(h.call_id)
            assert record is not None and record.usage and record.usage["in"] > 0
            day = time.strftime("%Y-%m-%d", time.gmtime())
            assert int(gw.conn.get(keys.usage_day(day, "alice"))) == record.usage["in"] + record.usage["out"]

            def counted() -> bool:
                stats = {k.decode(): v for k, v in gw.conn.hgetall(keys.STATS).items()}
                return f"tokens|bob|{MODEL}|in" in stats and int(stats[f"pcalls|bob|llm|{MODEL}"]) == 5

            wait_until(counted, message="the usage in hermes:stats")
            # Operators see the limiter and each principal's tokens: status, the console, /metrics.
            from hermes_gateway.console_data import snapshot
            from hermes_gateway.serve_metrics import GatewayMetrics
            from hermes_gateway.views import flow_control_data

            [row] = flow_control_data(gw.conn)["rate_limits"]
            assert row["key"] == CKEY and row["limits"] == {"tokens_per_minute": 3000} and row["waiting"] == 0
            assert 0 <= row["left"]["tokens_per_minute"] < 3000  # what the last minute's calls used
            usage = {(u["principal"], u["name"]): u for u in snapshot(gw)["usage"]}
            assert usage[("bob", CKEY)]["calls"] == 5 and usage[("bob", CKEY)]["tokens_out"] > 0
            metrics = GatewayMetrics(gw)
            try:
                text = metrics.render().decode()
            finally:
                metrics.close()
            tokens = [line for line in text.splitlines() if line.startswith("hermes_llm_tokens_total{")]
            assert any(f'direction="in",model="{MODEL}",' in t and 'principal="bob"' in t for t in tokens), tokens
            assert "hermes_rate_limit" in text and 'hermes_rate_kind="tokens_per_minute"' in text
        finally:
            gw.close()


def test_a_tool_rate_limit_holds_across_workers_and_queue_partitions(gateway: Any, workers: Any) -> None:
    gateway.register_tool(
        {
            "name": "limited", "executor": "python", "function": "workers.executors.builtin:echo",
            "concurrency": 100, "queue_partitions": 2, "rate_limit": {"requests_per_second": 6},
        }
    )
    workers(2)
    handles = [gateway.call_tool("limited", {"i": i}) for i in range(18)]
    for h in handles:
        h.result(30)
    started = [_started(h) for h in handles]
    # 6 a second, split 3 + 3 over the two partitions (each its own slot), so exact in sum.
    assert _most_in_window(started, 1.0) <= 6
    assert max(started) - min(started) >= 1.9  # 18 calls at 6/s: three windows


@pytest.fixture
def backend(home: Home) -> Iterator[Recorder]:
    """A real HTTP back end on 127.0.0.1 recording when each request came in, reachable by the workers."""
    home.config({"executors": {"http": {"allow_networks": ["127.0.0.1/32"]}}})
    server = Recorder()
    yield server
    server.close()


def _http_tool(backend: Recorder, **fields: Any) -> dict[str, Any]:
    return {"name": "hits", "executor": "http", "endpoint": f"{backend.base}/hit", "concurrency": 50, **fields}


def test_a_limit_raised_or_removed_while_calls_wait_lets_them_go_at_once(
    gateway: Any, workers: Any, backend: Recorder
) -> None:
    gateway.register_tool(_http_tool(backend, rate_limit={"requests_per_second": 1}))
    workers(2)
    handles = [gateway.call_tool("hits", {"i": i}) for i in range(6)]
    wait_until(lambda: backend.received, message="the first request")
    gateway.register_tool(_http_tool(backend, rate_limit={"requests_per_second": 50}))
    changed = time.time()
    for h in handles:
        h.result(15)
    assert max(backend.received) - changed < 2.5  # (at 1/s the last would come 5 s after the first)
    gateway.register_tool(_http_tool(backend, rate_limit={"requests_per_second": 1}))
    wait_until(lambda: time.time() - max(backend.received) > 1.0, message="the window to pass")
    handles = [gateway.call_tool("hits", {"i": i}) for i in range(6)]
    wait_until(lambda: len(backend.received) > 6, message="the first request")
    gateway.register_tool(_http_tool(backend))  # the limit removed
    changed = time.time()
    for h in handles:
        h.result(15)
    assert len(backend.received) == 12 and max(backend.received) - changed < 2.5


def test_a_limit_lowered_while_calls_wait_holds_at_once(gateway: Any, workers: Any, backend: Recorder) -> None:
    gateway.register_tool(_http_tool(backend, rate_limit={"requests_per_second": 5}))
    workers(2)
    handles = [gateway.call_tool("hits", {"i": i}) for i in range(8)]
    wait_until(lambda: len(backend.received) == 5, message="the first second's five")
    gateway.register_tool(_http_tool(backend, rate_limit={"requests_per_second": 1}))
    changed = time.time()
    for h in handles:
        h.result(15)
    later = [t for t in backend.received if t > changed]
    assert len(later) == 3 and _most_in_window(later, 1.0) == 1  # (the old limit sent the three at once)


def test_a_429_from_a_rate_limited_tool_pauses_all_its_partitions_for_the_fleet(
    gateway: Any, workers: Any, backend: Recorder
) -> None:
    backend.replies.append((429, {"Retry-After": "30"}))  # (more than the tool's retry.max_backoff: 1 s)
    spec = _http_tool(backend, queue_partitions=2, rate_limit={"requests_per_second": 10}, retry={"max_backoff": 1})
    gateway.register_tool(spec)
    workers(2)
    first = gateway.call_tool("hits", {"i": 0})
    wait_until(lambda: backend.received, message="the refused request")
    # (its worker pauses the key, then moves it back to waiting: calls sent before that could not be held)
    wait_until(lambda: gateway.calls.record(first.call_id)["state"] not in ("routing", "executing"),
               message="the refused call back to waiting")
    rest = [gateway.call_tool("hits", {"i": i}) for i in range(1, 7)]  # (both partitions, both workers)
    for h in [first, *rest]:
        h.result(15)
    refused, *later = backend.received
    assert len(later) == 7  # each call once more: the refused one went back to waiting, not failed
    assert min(later) >= refused + 0.95 and max(later) < refused + 5  # paused 1 s (not 30) for everyone
    back = [e for e in first.events(timeout=5) if e.state == "retrying"]
    assert back and back[0].detail["reason"] == "rate_limited"


def _started(handle: Any) -> float:
    """When the call's (one) attempt started executing: from its events, or from the moves its terminal
    event keeps (``steps``) when the handle caught up with an ended call whose history was trimmed."""
    heard = list(handle.events(timeout=5))
    ts = [e.ts for e in heard if e.type == "transition" and e.state == "executing"]
    if not ts:
        end = heard[-1]
        ts = [end.ts - us / 1e6 for state, _, us in end.steps or [] if state == "executing"]
    assert len(ts) == 1, heard
    return ts[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.redis_stack import ClusterStack

    with ClusterStack(3, tmp_path_factory.mktemp("rate-e2e-cluster")) as c:
        yield c


def test_a_tool_rate_limit_holds_with_real_workers_on_a_cluster(
    cluster: Any, home: Home, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hermes_gateway.client import Gateway
    from tests.conftest import WorkerFactory

    for port in cluster.ports:
        cluster.node(port).flushall()
    monkeypatch.setenv("HERMES_REDIS_URL", cluster.url())
    logs = tmp_path / "logs"
    logs.mkdir()
    factory = WorkerFactory(cluster.url(), home, logs)
    gw = Gateway.connect(cluster.url(), home=str(home.path), embedded_ok=False, check_workers=False)
    try:
        gw.register_tool(
            {
                "name": "limited", "executor": "python", "function": "workers.executors.builtin:echo",
                "concurrency": 100, "queue_partitions": 3, "rate_limit": {"requests_per_second": 6},
            }
        )
        factory(2)
        handles = [gw.call_tool("limited", {"i": i}) for i in range(18)]
        for h in handles:
            h.result(30)
        started = [
            e.ts for h in handles for e in h.events(timeout=5) if e.type == "transition" and e.state == "executing"
        ]
        assert len(started) == 18 and _most_in_window(started, 1.0) <= 6  # 2 per partition, three shards
        assert max(started) - min(started) >= 1.9
    finally:
        gw.close()
        factory.stop_all()
    for w in factory.started:
        bad = [line for line in w.log().splitlines() if "transition not written" in line or "outbox batch failed" in line]
        assert bad == [], bad[:3]


def test_retries_of_failed_attempts_count_against_the_limit(llm: LLMServer, home: Home, gateway: Any, workers: Any) -> None:
    # Each call's first request fails with a 500 the worker retries at once: every retry is a request the
    # provider receives, so it must be admitted by the limiter as the first was.
    _config(home, llm, {"requests_per_second": 5}, retries=2)  # (the workers read the retries)
    seen: set[str] = set()

    def first_fails(body: dict[str, Any]) -> Reply | None:
        ask = body["messages"][0]["content"]
        if ask in seen:
            return None
        seen.add(ask)
        return Reply(status=500, error="oops", headers={"Retry-After": "0"})

    llm.rule = first_fails
    workers(2, queues="llm")
    handles = [gateway.call_llm({"messages": [{"role": "user", "content": f"ask {i}"}]}) for i in range(10)]
    for h in handles:
        assert h.result(30)["choices"][0]["message"]["content"]
    received = [r.received for r in llm.chat_requests]
    assert len(received) == 20  # each call failed once, then answered
    assert _most_in_window(received, 1.0) <= 5
