"""``status --watch``: the figures workers add to Redis, read back and drawn."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console

from broker import keys
from hermes_gateway.watch import figures, render, watch
from workers import telemetry as metrics


def workload(fake: Any) -> None:
    """What a worker would have counted: 3 done and 1 failed get_weather calls, 1 cancelled LLM call."""
    metrics.flush(fake.pipeline())  # drop what other tests in this process counted
    fake.delete(keys.STATS)
    for duration, state, etype in (
        (0.1, "done", None),
        (0.2, "done", None),
        (0.3, "done", None),
        (0.4, "failed", "tool_timeout"),
    ):
        metrics.call_started("tool:get_weather", "tools", 0.05)
        metrics.call_ended("tool:get_weather", "tool", "get_weather", state, etype, duration)
    metrics.call_started("llm:gpt", "llm", 0.25)
    metrics.call_ended("llm:gpt", "llm", "gpt", "cancelled", None, 1.0)
    pipe = fake.pipeline()
    assert metrics.flush(pipe)
    pipe.execute()
    fake.hset(keys.stats_inflight("w1"), mapping={"tool:get_weather": 2})
    fake.hset(keys.stats_inflight("w2"), mapping={"tool:get_weather": 1, "llm:gpt": 4})
    fake.hset(keys.stats_inflight("gone"), mapping={"tool:get_weather": 9})  # (no worker on record: not read)
    fake.zadd(keys.STATS_INFLIGHT_BY, {"w1": time.time(), "w2": time.time()})  # (as their flushers write it)
    fake.sadd(keys.BREAKERS, "tool:get_weather")
    fake.hset(keys.breaker("tool:get_weather"), "state", "open")
    fake.sadd(keys.RQ_QUEUES, keys.queue("tools"))
    fake.rpush(keys.queue("tools"), "a", "b")


def test_figures_sum_what_the_workers_reported(fake: Any) -> None:
    workload(fake)
    data = figures(fake)
    weather = data["calls"]["tool:get_weather"]
    assert weather["states"] == {"done": 3, "failed": 1} and weather["n"] == 4
    assert round(weather["duration_s"], 6) == 1.0
    assert data["calls"]["llm:gpt"]["states"] == {"cancelled": 1}
    assert data["errors"] == {("tool:get_weather", "tool_timeout"): 1}
    assert round(data["queue_wait"]["tools"], 6) == 0.05 and round(data["queue_wait"]["llm"], 6) == 0.25
    assert data["inflight"] == {"tool:get_weather": 3, "llm:gpt": 4}
    assert data["breakers"] == {"tool:get_weather": "open"}
    assert data["queues"] == {"tools": 2}


def test_the_view_draws_counts_means_and_rates(fake: Any) -> None:
    workload(fake)
    before = figures(fake)
    after = {**figures(fake), "ts": before["ts"] + 2.0}
    after["calls"]["tool:get_weather"] = {"states": {"done": 7, "failed": 1}, "duration_s": 1.0, "n": 8}
    out = Console(record=True, width=150)
    out.print(render(after, before))
    text = out.export_text()
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if "│" in line]
    # name, done, failed, cancelled, other, mean ms (1.0 s / 8 calls), per s ((8 - 4) calls in 2 s)
    assert ["tool:get_weather", "7", "1", "0", "0", "125.0", "2.0"] in rows
    assert "tool_timeout" in text and "open" in text


def test_watch_refreshes_then_returns(fake: Any) -> None:
    workload(fake)
    out = Console(record=True, width=150)
    watch(fake, interval=0.01, rounds=2, console=out)
    assert "get_weather" in out.export_text()


def test_json_figures_are_plain_data_and_watch_json_prints_one_line_per_refresh(fake: Any) -> None:
    import json

    from hermes_gateway.watch import figures_json, watch_json

    workload(fake)
    data = json.loads(json.dumps(figures_json(fake)))  # survives a JSON round trip
    assert data["errors"] == [{"call": "tool:get_weather", "error_type": "tool_timeout", "count": 1}]
    assert data["calls"]["tool:get_weather"]["states"] == {"done": 3, "failed": 1}
    assert data["inflight"] == {"tool:get_weather": 3, "llm:gpt": 4}
    lines: list[str] = []
    watch_json(fake, interval=0.01, rounds=2, out=lines.append)
    assert len(lines) == 3 and all(json.loads(x)["breakers"] == {"tool:get_weather": "open"} for x in lines)


def test_status_json_carries_the_live_figures(redis_url: str, monkeypatch: Any) -> None:
    import json

    import redis
    from click.testing import CliRunner

    from hermes_gateway.cli import main

    conn = redis.Redis.from_url(redis_url)
    workload(conn)
    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["status", "--json"])
    assert result.exit_code == 0, result.output
    figures_ = json.loads(result.output)["figures"]
    assert figures_["calls"]["llm:gpt"]["states"] == {"cancelled": 1}
    assert figures_["queues"] == {"tools": 2} and figures_["breakers"] == {"tool:get_weather": "open"}


def test_status_counts_running_and_waiting_calls_of_their_key(redis_url: str, monkeypatch: Any) -> None:
    import json

    import redis
    from click.testing import CliRunner

    from broker.calls import Calls
    from hermes_gateway.cli import main
    from tests.broker.test_limits import CKEY, submit

    conn = redis.Redis.from_url(redis_url)
    calls = Calls(conn)
    for i in range(5):
        submit(calls, f"c{i}", limit=1, queue_size=50)
    calls.claim(["tools"], 10, "w1", 30)  # c0 runs; c1..c4 wait for its slot
    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["status", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["waiting_by_key"] == {CKEY: 4}
    assert data["concurrency"] == [{"key": CKEY, "limit": 1, "running": 1, "waiting": 4}]
