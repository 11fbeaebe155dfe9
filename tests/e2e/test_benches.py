"""The benchmarks still run, small, against the test Redis, and what they check still holds.

Performance itself is measured by running them in full (docs/benchmarks.md), never asserted here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def bench(script: str, *args: str, timeout: float = 180) -> list[str]:
    # Results go to a scratch directory: a test run leaves bench/results/ as the benchmarks' real runs left it.
    scratch = tempfile.mkdtemp(prefix="hermes-bench-results-")
    out = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=REPO,
        env={**os.environ, "HERMES_BENCH_RESULTS": scratch},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_io_bound_holds_the_limit_and_prints_its_efficiency_and_cpu_ceiling(redis_url: str) -> None:
    lines = bench("io_bound.py", "--url", redis_url, "-n", "300", "--limit", "20", "--rounds", "2", "--skip-rq")
    rounds = [line for line in lines if line.startswith("round ")]
    assert len(rounds) == 2
    for line in rounds:
        assert int(re.search(r"max_executing=(\d+)", line)[1]) <= 20  # type: ignore[index]
        assert int(re.search(r"max_slots_held=(\d+)", line)[1]) <= 20  # type: ignore[index]
        assert 0 < float(re.search(r"cpu_ceiling=([0-9.]+)", line)[1]) <= 1  # type: ignore[index]
    assert "limit held" in lines
    assert re.fullmatch(r"efficiency=[0-9.]+ +\(median; target >= 0\.85\)", lines[-1])


def test_rq_ratelimit_compares_the_limit_a_dead_workers_slot_and_submission(redis_url: str) -> None:
    lines = bench("rq_ratelimit.py", "--url", redis_url, "--jobs", "6", "-n", "300", "--wait", "6", "--lease", "1")
    limit = next(line for line in lines if line.startswith("1. "))
    assert "RQ RateLimit peak started=2 (ran 6)" in limit and "ours peak executing=2 (ran 6)" in limit
    dead = next(line for line in lines if line.startswith("2. "))
    ours = re.search(r"ours ([0-9.]+)s \(lease 1s", dead)
    assert ours is not None and float(ours[1]) < 6
    bound = next(line for line in lines if "one past the waiting bound" in line)
    assert "ours: QueueFull" in bound
    assert re.fullmatch(r"ratio_vs_rq=[0-9.]+", lines[-1])


def test_provider_sdk_compares_our_provider_with_the_openai_sdk_on_the_same_server() -> None:
    lines = bench("provider_sdk.py", "-n", "3", "--chunks", "20", "--rounds", "1")
    assert lines[0].startswith("round 1: ours_stream=")
    assert re.fullmatch(r"sdk_whole_cpu_ratio=[0-9.]+", lines[-2])
    assert re.fullmatch(r"sdk_cpu_ratio=[0-9.]+", lines[-1])


def test_scale_out_measures_redis_cpu_side_by_side_with_rq_and_a_sentinel_failover() -> None:
    # Its own redis-server processes (plain, a Sentinel set-up, a cluster when redis+cluster:// is known).
    # (--reuse-fleet: the plain and cluster lines' 1- and 2-process figures are the fleet's runs, not 4 more)
    out = bench("scale_out.py", "-n", "150", "--rounds", "1", "--fleet", "1,2", "--reuse-fleet", "--failover-calls", "60",
                "--lease", "2", timeout=420)  # fmt: skip
    lines = [line for line in out if not line.startswith("20")]  # (worker log lines share its stdout)
    plain = next(line for line in lines if line.startswith("plain Redis: ") and "Redis CPU per call" in line)
    fleet = [line for line in lines if re.match(r"\s+[12]\s+[0-9,]+\s+[0-9.]+x", line)]
    assert len(fleet) in (2, 4), lines  # 1 and 2 worker processes on plain Redis (and on the cluster)
    assert float(re.search(r"([0-9.]+) µs Redis CPU per call", plain)[1]) > 0  # type: ignore[index]
    rq = next(line for line in lines if line.startswith("stock RQ, plain Redis: "))
    assert float(re.search(r"([0-9.]+) µs Redis CPU per job", rq)[1]) > 0  # type: ignore[index]
    sentinel = next(line for line in lines if line.startswith("Sentinel (wait_replicas 1): "))
    assert "node-a" in sentinel and "node-b" in sentinel and "sentinel-2" in sentinel
    failover = next(line for line in lines if line.startswith("failover "))
    figures = dict(re.findall(r"(lost|stuck|duplicated)=(\d+)", failover))
    assert figures["lost"] == "0" and figures["stuck"] == "0", failover
    reported = re.search(r"reported as attempt > 1: (\d+)", failover)
    assert reported is not None and reported[1] == figures["duplicated"], failover
    assert re.fullmatch(r"busiest_shard_share=([0-9.]+|n/a)", lines[-1])
    if lines[-1] == "busiest_shard_share=n/a":
        assert any(line.startswith("cluster: ") for line in lines)
    else:
        assert any(line.startswith("cluster, 3 primaries, 6 queues") for line in lines)
        assert any(line.startswith("cluster, 3 primaries, 1 queue with queue_partitions: 6") for line in lines)


def test_batch_rss_runs_a_batch_per_count_and_extrapolates_the_submitters_peak(redis_url: str) -> None:
    lines = bench("batch_rss.py", "--url", redis_url, "--counts", "200,400")
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [r["n"] for r in rows] == [200, 400] and all(r["peak_mb"] >= r["base_mb"] > 0 for r in rows)
    assert re.fullmatch(r"extrapolated_peak_mb_1m=[0-9.]+", lines[-1])


def test_durability_measures_each_persistence_setting_and_counts_runs_across_a_redis_kill(tmp_path: Path) -> None:
    # Its own redis-server processes: appendonly off, everysec, always, and a primary with a replica.
    out = tmp_path / "durability.json"
    lines = bench("durability.py", "-n", "100", "--singles", "20", "--rounds", "1", "--kill-calls", "30",
                  "--kill-trials", "1", "--lease", "2", "--out", str(out), timeout=420)  # fmt: skip
    for mode in ("off", "everysec", "always", "replica"):
        line = next(line for line in lines if line.startswith(f"{mode}: "))
        assert re.search(r"[0-9,]+ calls/s; submit p50 [0-9.]+ ms, p99 [0-9.]+ ms", line), line
    for mode in ("everysec", "always"):
        kill = next(line for line in lines if line.startswith(f"kill -9 ({mode})"))
        assert "30 calls accepted, lost=0 stuck=0" in kill and "never_ran=0" in kill, kill
    result = json.loads(out.read_text())
    assert set(result["median"]) == {"off", "everysec", "always", "replica"} and len(result["kill9"]) == 2
    assert re.fullmatch(r"always_vs_everysec=[0-9.]+", lines[-1])


def test_mix_measures_an_interactive_call_alone_and_behind_a_batch(redis_url: str) -> None:
    lines = bench(
        "mix.py", "--url", redis_url, "--items", "400", "--window", "100", "--samples", "10",
        "--fifo-samples", "1", "--no-memory", "--no-save", "--peer-samples", "5", "--peer-fifo-samples", "1",
        "--limit", "2",  # (2 RQ worker processes, not 8: the suite's two cores)
    )  # fmt: skip
    alone = next(line for line in lines if line.startswith("interactive alone:"))
    behind = next(line for line in lines if line.startswith("interactive behind batch:"))
    assert re.search(r"p99 [0-9.]+ ms", alone) and re.search(r"p99 [0-9.]+ ms", behind)
    # The wait for a slot, read from the steps an ended call keeps (its workers keep no whole history).
    assert re.search(r"submit -> a worker starts it: alone p50 [0-9.]+ / p99 [0-9.]+ ms", "\n".join(lines))
    # The same scenario on the peers, each behind a backlog of its own batch (a queue of its own, the batch's).
    for peer in ("Dramatiq 1x2", "stock RQ, 2 SimpleWorkers"):
        line = next(line for line in lines if line.startswith(f"{peer}:"))
        assert re.search(r"alone p50 [0-9.]+ / p99 [0-9.]+ ms", line), line
        backlog = re.search(r"behind the batch \(([0-9,]+) unfinished\)", line)
        assert backlog is not None and int(backlog[1].replace(",", "")) >= 50, line
        assert re.search(r"in the batch's queue p50 [0-9.]+ ms", line), line
    assert re.fullmatch(r"interactive_slowdown=[0-9.]+", lines[-1])


def test_latency_measures_one_call_at_a_time_beside_dramatiq_and_rq(redis_url: str) -> None:
    lines = bench("latency.py", "--url", redis_url, "-n", "20")
    for who in ("ours:", "Dramatiq:", "stock RQ:"):
        line = next(line for line in lines if line.startswith(who))
        assert re.search(r"p50 [0-9.]+ ms +p99 [0-9.]+ ms", line), line
    result = next(line for line in lines if line.startswith("result: "))
    record = json.loads(Path(result.removeprefix("result: ")).read_text())
    assert set(record) >= {"ours", "dramatiq", "rq", "commit"} and record["calls"] == 20
    assert any(re.fullmatch(r"p50_ratio_vs_dramatiq=[0-9.]+", line) for line in lines)
    assert re.fullmatch(r"p50_ratio_vs_rq=[0-9.]+", lines[-1])


def test_memory_counts_the_bytes_a_finished_call_keeps_beside_dramatiq_and_rq(tmp_path: Path) -> None:
    from tests.redis_stack import data_node

    server = data_node(tmp_path, "memory").start()  # its own Redis: used_memory moves with this run alone
    try:
        lines = bench("memory.py", "--url", f"redis://127.0.0.1:{server.port}/0", "-n", "500")
    finally:
        server.stop()
    assert 0 < int(re.search(r"record_bytes=(\d+)", "\n".join(lines))[1]) <= 800  # type: ignore[index]
    peers = next(line for line in lines if line.startswith("Dramatiq (Results on Redis):"))
    found = re.fullmatch(r"Dramatiq \(Results on Redis\): (-?[0-9.]+) bytes a finished job; stock RQ: (-?[0-9.]+)", peers)
    assert found is not None, peers
    # Dramatiq keeps a result alone; RQ its job hash, result stream and registry entry (kilobytes a job).
    assert 0 < float(found[1]) < 1000 and float(found[2]) > 1000, peers
    ours = re.fullmatch(r"bytes_per_call=(-?[0-9.]+) +\(.*\)", lines[-1])
    assert ours is not None and 0 < float(ours[1]) < float(found[2]), lines[-1]


def test_throughputs_command_count_counts_each_command_a_script_calls(redis_url: str) -> None:
    from bench.throughput import Cpu
    from broker.connection import from_url

    conn = from_url(redis_url)
    cpu = Cpu(conn, [])
    before = cpu.commands()
    conn.eval("redis.call('PING') redis.call('PING') redis.call('PING') return 1", 0)
    # The EVAL, its three PINGs and the INFO that reads the count (others' commands only add to it).
    assert cpu.commands() - before >= 5
    conn.close()


def test_throughputs_switch_count_sums_every_thread_and_grows_when_one_sleeps() -> None:
    import threading
    import time

    from bench.throughput import switches

    slept, done = threading.Event(), threading.Event()

    def nap() -> None:
        time.sleep(0.01)  # blocking is a voluntary switch of this thread
        slept.set()
        done.wait(10)

    before = switches(os.getpid())
    napper = threading.Thread(target=nap)
    napper.start()
    try:
        assert slept.wait(10)
        status = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/status").read_text()
        main_thread = sum(int(x.split()[-1]) for x in status.splitlines() if "ctxt_switches:" in x)
        # The napper is alive with a switch of its own: the sum is more than this thread's count.
        now = switches(os.getpid())
        assert before is not None and now is not None and now > main_thread and now >= before + 1
    finally:
        done.set()
        napper.join()
    assert switches(2**22 + 7) is None  # no such process here: no count, not a zero


def test_one_warm_call_crosses_at_most_25_of_our_modules_on_three_worker_threads(redis_url: str) -> None:
    # docs/ARCHITECTURE.md's walk of one call names these figures (issue 32's goal: at most 25 modules).
    lines = bench("call_walk.py", "--url", redis_url)
    found = re.fullmatch(r"worker side: (\d+) modules, (\d+) functions, (\d+) threads \((.*)\)", lines[-1])
    assert found is not None, lines[-3:]
    modules, functions, threads = (int(found[i]) for i in (1, 2, 3))
    assert 0 < modules <= 25 and functions > 0, lines[-4:]  # (0: the walk recorded nothing)
    assert threads == 3 and found[4] == "hermes-call, hermes-dispatch, hermes-outbox"
