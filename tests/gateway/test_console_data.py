"""The console's snapshot readers: call figures from hermes:stats, late workers, breakers (on fakeredis), and
a tool row naming the queue no worker listens on (on the test Redis, with a real worker)."""

from __future__ import annotations

from typing import Any

from broker import keys
from hermes_gateway import console_data
from workers.telemetry import LATENCY_BOUNDS, SEP, Timing, parse_stats


def test_call_figures_sum_states_and_duration_buckets_per_tool() -> None:
    stats = {
        f"calls{SEP}tool{SEP}echo{SEP}done{SEP}": "5",
        f"calls{SEP}tool{SEP}echo{SEP}failed{SEP}executor_error": "2",
        f"calls{SEP}tool{SEP}a{SEP}b{SEP}retrying{SEP}": "1",  # a name holding the separator
        f"lat{SEP}tool{SEP}echo{SEP}0": "4",
        f"lat{SEP}tool{SEP}echo{SEP}{len(LATENCY_BOUNDS)}": "3",
        f"lat{SEP}tool{SEP}a{SEP}b{SEP}2": "1",
        f"lat{SEP}tool{SEP}echo{SEP}99": "7",  # out of range: ignored
        f"duration{SEP}tool{SEP}echo": "12.5",
        f"wait{SEP}tools": "0.3",
    }
    parsed = parse_stats(stats)
    got = console_data.call_figures(parsed)
    assert got["states"] == {"done": 5, "failed": 2, "retrying": 1}
    assert got["by_tool"] == {"tool:echo": {"done": 5, "failed": 2}, "tool:a|b": {"retrying": 1}}
    counts = got["latency"]["counts"]
    assert len(counts) == len(LATENCY_BOUNDS) + 1 and counts[0] == 4 and counts[-1] == 3 and counts[2] == 1
    assert parsed.latency[("tool", "a|b")][2] == 1 and parsed.durations == {("tool", "echo"): Timing(12.5)}


def test_a_worker_is_late_past_two_heartbeat_intervals(fake: Any) -> None:
    now = 1000.0
    for name, beat in (("fresh", now - 1.0), ("late", now - 7.0)):
        fake.zadd(keys.WORKERS, {name: beat})
        fake.hset(keys.worker(name), mapping={"heartbeat": beat, "heartbeat_interval": 2.0, "pid": 7,
                                              "queues": "tools,llm", "concurrency": 4, "inflight": 1})
    fake.zadd(keys.WORKERS, {"gone": now})  # its hash expired: not listed
    rows = {w["name"]: w for w in console_data.workers(fake, lease=30.0, now=now)}
    assert set(rows) == {"fresh", "late"}
    assert rows["fresh"]["late"] is False and rows["late"]["late"] is True  # 7 s > 2 x 2 s + 1 s
    assert rows["fresh"]["queues"] == ["tools", "llm"] and rows["fresh"]["inflight"] == 1


def test_an_open_breaker_says_when_its_next_probe_may_go(fake: Any) -> None:
    fake.sadd(keys.BREAKERS, "tool:x", "tool:y")
    fake.hset(keys.breaker("tool:x"), mapping={"state": "open", "opened_at": 100.0, "failures": 0})
    fake.hset(keys.breaker("tool:y"), mapping={"state": "half_open", "probe": "c1"})
    rows = {b["key"]: b for b in console_data.breakers(fake, {"tool:x": 30.0})}
    assert rows["tool:x"]["next_probe_at"] == 130.0 and rows["tool:x"]["cooldown"] == 30.0
    assert rows["tool:y"]["state"] == "half_open" and "next_probe_at" not in rows["tool:y"]


def test_each_process_of_a_pool_serves_metrics_on_its_own_port(tmp_path: Any) -> None:
    from broker.config import METRICS_PORT_ENV, load_settings
    from workers.pool import metrics_env

    workers = load_settings(tmp_path, environ={}).workers
    assert metrics_env(0, workers) is None  # no --metrics-port: the children inherit the environment as is
    workers = load_settings(tmp_path, environ={METRICS_PORT_ENV: "9464"}).workers
    assert [metrics_env(i, workers)[METRICS_PORT_ENV] for i in range(3)] == ["9464", "9465", "9466"]  # type: ignore[index]


def test_the_trace_link_template_comes_from_the_environment_or_config_yaml(tmp_path: Any, monkeypatch: Any) -> None:
    from broker.config import load_settings

    monkeypatch.delenv("HERMES_TRACE_URL", raising=False)
    assert load_settings(tmp_path).console.trace_url is None
    (tmp_path / "config.yaml").write_text("console:\n  trace_url: http://tempo:3200/trace/{trace_id}\n")
    assert load_settings(tmp_path).console.trace_url == "http://tempo:3200/trace/{trace_id}"
    monkeypatch.setenv("HERMES_TRACE_URL", "http://localhost:16686/trace/{trace_id}")
    assert load_settings(tmp_path).console.trace_url == "http://localhost:16686/trace/{trace_id}"


def test_a_tool_whose_queue_no_worker_listens_on_blames_the_queue_not_the_limit(
    home: Any, gateway: Any, workers: Any
) -> None:
    home.echo_tool("greet", queue="demo", concurrency=1)
    gateway.sync_tools()
    handles = gateway.map("greet", [{"i": i} for i in range(3)])  # (the fixture's gateway does not refuse)
    row = next(r for r in console_data.snapshot(gateway)["limits"] if r["key"] == "tool:greet")
    assert row["no_worker"] == "demo" and not row["bottleneck"], row
    workers(1, queues="demo")
    assert [h.result(20) for h in handles] == [{"i": i} for i in range(3)]
    row = next(r for r in console_data.snapshot(gateway)["limits"] if r["key"] == "tool:greet")
    assert row["no_worker"] is None, row
