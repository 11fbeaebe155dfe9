"""I/O-bound calls under a cluster-wide concurrency limit: our stack against stock RQ on the same Redis.

2,000 calls of a tool that waits 50 ms (``workers.executors.builtin:sleep``), executor concurrency 100,
two worker processes. Prints the highest number of calls ever executing at once (from the executing and
formatting events' timestamps, and the peak size of the slot set sampled in Redis; both must equal the
limit, never more), the wall time against the limit-bound ideal as ``efficiency=<ideal/actual>`` (the
median of ``--rounds`` rounds on the same workers), and the same workload on Dramatiq (as many processes,
``limit / processes`` threads each: the same number of jobs at once; its actor stores its result as our
calls do, done when the last is acked) and on stock ``rq worker-pool`` with as many processes (one round
each; RQ's job function is ``bench.rqjobs.sleep``, which imports nothing of ours). The last line is
``ratio_vs_rq=<x>``, after ``ratio_vs_dramatiq=<x>`` (their wall time / ours).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS,
    ROOT,
    Peak,
    commit,
    dramatiq_results,
    scratch_home,
    shown,
    start_dramatiq,
    start_workers,
    stop,
    using_broker,
    wait_for_workers,
)
from hermes_gateway.client import SUBMIT_CHUNK  # noqa: E402


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    marks = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = now = 0
    for _, d in marks:
        now += d
        best = max(best, now)
    return best


def _executing_intervals(conn: object, ids: list[str]) -> tuple[list[tuple[float, float]], Counter[str]]:
    """(executing → formatting intervals, calls run per worker) from the calls' event histories."""
    from broker import events, keys

    pipe = conn.pipeline(transaction=False)  # type: ignore[attr-defined]
    for cid in ids:
        pipe.lrange(keys.history(cid), 0, -1)
    out = []
    workers: Counter[str] = Counter()
    for cid, raw in zip(ids, pipe.execute(), strict=True):
        start = None
        for ev in (events.decode(b, cid) for b in raw):
            if ev.type != events.TRANSITION:
                continue
            if ev.state == "routing":
                workers[str((ev.detail or {}).get("worker"))] += 1
            elif ev.state == "executing":
                start = ev.ts
            elif ev.state == "formatting" and start is not None:
                out.append((start, ev.ts))
    return out, workers


def run_ours(
    url: str, n: int, limit: int, processes: int, seconds: float, rounds: int = 1
) -> list[Round]:
    """Per round: (wall seconds, peak executing from events, peak slots held, calls per worker, mean
    number of calls executing).

    The same worker processes serve every round, as a long-running pool would.
    """
    from broker.config import load_settings
    from broker.connection import from_url
    from hermes_gateway import Gateway
    from hermes_gateway.client import BrokerHandle

    queue = f"iobench-{uuid.uuid4().hex[:8]}"
    name = f"wait_{queue.replace('-', '_')}"
    tool = {
        "name": name,
        "executor": "python",
        "function": "workers.executors.builtin:sleep",
        "concurrency": limit,
        "queue_size": n * 2,
        "queue": queue,
        "timeout": 30,
        "input_schema": {"type": "object", "properties": {"seconds": {"type": "number"}}},
    }
    home = scratch_home([tool])
    conn = from_url(url)
    # Each process could run every call alone: the cluster-wide limit is what holds them back.
    # (the executing intervals are read from the calls' whole histories: ended calls keep them only so)
    procs = start_workers(url, home, queue, processes, limit, {"HERMES_KEEP_HISTORY": "1"})
    try:
        wait_for_workers(conn, processes, queue)
        gw = Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))
        gw.sync_tools(home / "tools")
        for h in gw.map(name, [{"seconds": 0.001}] * (10 * processes)):
            h.result(30)
        results = [_round(gw, conn, name, n, seconds, procs) for _ in range(rounds)]
        gw.close()
        return results
    finally:
        stop(procs)


# secs, executing, slots held, per worker, mean executing, CPU µs per call (client, workers, Redis)
Round = tuple[float, int, int, list[int], float, tuple[float, float, float]]


def _cpu(conn: Any, procs: list[Any]) -> tuple[float, float, float]:
    """CPU seconds so far of this process, the worker processes and the Redis server."""
    import psutil

    own = sum(psutil.Process().cpu_times()[:2])
    workers = 0.0
    for p in procs:
        try:
            workers += sum(psutil.Process(p.pid).cpu_times()[:2])
        except psutil.Error:
            pass
    info = conn.info("cpu")
    return own, workers, float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _round(gw: Any, conn: Any, name: str, n: int, seconds: float, procs: list[Any]) -> Round:
    from broker import keys

    # A cross-check of the events' figure, every 5 ms: each sample is a round trip of this process, and
    # sampling faster took CPU from the run it measures on a small machine.
    held = keys.slots(keys.tag(str(gw.tool(name).spec.config.get("queue") or "tools")), f"tool:{name}")
    with Peak(lambda: conn.zcard(held), 0.005) as peak:
        cpu0 = _cpu(conn, procs)
        start = time.perf_counter()
        handles = []
        for i in range(0, n, SUBMIT_CHUNK):  # batches of one pipeline: workers start on the first at once
            handles.extend(gw.map(name, [{"seconds": seconds}] * min(SUBMIT_CHUNK, n - i)))
        for h in handles:
            h.result(300)
        elapsed = time.perf_counter() - start
        cpu = tuple((b - a) / n * 1e6 for a, b in zip(cpu0, _cpu(conn, procs), strict=True))
    intervals, workers = _executing_intervals(conn, [h.call_id for h in handles])
    mean = sum(e - s for s, e in intervals) / elapsed  # calls executing on average over the round
    share = sorted(workers.values(), reverse=True)
    return elapsed, _max_overlap(intervals), peak.value, share, mean, cpu  # type: ignore[return-value]


def cpu_ceiling(cpu_us: tuple[float, float, float], cores: int, limit: int, seconds: float) -> float:
    """The best efficiency this machine's cores allow at the round's CPU per call (client + workers +
    Redis, all on the same cores here): limit-bound needs ``limit / seconds`` calls a second."""
    per_call = sum(cpu_us) / 1e6
    return min(1.0, cores / (per_call * limit / seconds)) if per_call > 0 else 1.0


def run_rq(url: str, n: int, processes: int, seconds: float) -> float:
    """Wall seconds for n sleep jobs on ``rq worker-pool -n processes``."""
    from rq import Queue

    from broker.connection import from_url

    conn = from_url(url)
    queue_name = f"rqiobench-{uuid.uuid4().hex[:8]}"
    q = Queue(queue_name, connection=conn)
    pool = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rq.cli",
            "worker-pool",
            "--url",
            url,
            "-n",
            str(processes),
            "--quiet",
            queue_name,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_workers(conn, processes, queue_name, timeout=60)
        q.enqueue_many(
            [Queue.prepare_data("bench.rqjobs.sleep", (0.001,)) for _ in range(2 * processes)]
        )
        _wait_finished(q, 2 * processes)
        base = q.finished_job_registry.count
        start = time.perf_counter()
        for i in range(0, n, 500):
            q.enqueue_many(
                [
                    Queue.prepare_data("bench.rqjobs.sleep", (seconds,))
                    for _ in range(min(500, n - i))
                ]
            )
        _wait_finished(q, base + n)
        return time.perf_counter() - start
    finally:
        stop([pool])


def run_dramatiq(url: str, n: int, processes: int, limit: int, seconds: float) -> float:
    """Wall seconds for n sleep messages on ``processes`` Dramatiq processes of ``limit / processes``
    threads, from the first send to the last ack."""
    from broker.connection import from_url

    tag = uuid.uuid4().hex[:8]
    queue, first = f"dqio-{tag}", f"dqio-{tag}-first"
    actors = dramatiq_results(url, queue, first)
    threads = max(1, limit // processes)
    procs = [p for _ in range(processes) for p in start_dramatiq(url, queue, first, threads)]
    conn = from_url(url)
    pending = f"dramatiq:{queue}.msgs"  # (every message not yet acked)
    try:
        for _ in range(2 * processes):  # warm: every worker up
            actors.batch_sleep.send(0.001)
        _until_acked(conn, pending)
        start = time.perf_counter()
        for _ in range(n):
            actors.batch_sleep.send(seconds)
        _until_acked(conn, pending)
        return time.perf_counter() - start
    finally:
        stop(procs)
        for key in conn.scan_iter(f"*{tag}*"):
            conn.delete(key)
        conn.close()


def _until_acked(conn: Any, key: str, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while conn.hlen(key):
        if time.monotonic() > deadline:
            raise RuntimeError("Dramatiq did not finish in time")
        time.sleep(0.01)


def _wait_finished(q: object, count: int, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while q.finished_job_registry.count < count:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise RuntimeError("stock RQ did not finish in time")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--calls", type=int, default=2000)
    parser.add_argument("--limit", type=int, default=100, help="executor concurrency (cluster-wide)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=0.05, help="how long each call waits")
    parser.add_argument("--url", default=None, help="Redis URL (default $HERMES_REDIS_URL, else embedded)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds on the same workers (median reported)")
    parser.add_argument("--skip-rq", action="store_true", help="ours only: no peers, no ratio lines")
    args = parser.parse_args()
    with using_broker(args.url) as url:
        n, limit = args.calls, args.limit
        ideal = n * args.seconds / limit
        print(
            f"broker: {url}; {n} calls of {args.seconds * 1000:g} ms, limit {limit}, {args.processes} processes"
        )
        results = run_ours(url, n, limit, args.processes, args.seconds, args.rounds)
        cores = os.cpu_count() or 1
        for i, (secs, ex, sl, share, mean, cpu) in enumerate(results, 1):
            print(
                f"round {i}: {secs:.3f}s ({n / secs:,.0f} calls/s)  efficiency={ideal / secs:.3f}  "
                f"max_executing={ex}  mean_executing={mean:.1f}  max_slots_held={sl}  calls per worker={share}  "
                f"cpu_us_per_call=client {cpu[0]:.0f} workers {cpu[1]:.0f} redis {cpu[2]:.0f}  "
                f"cpu_ceiling={cpu_ceiling(cpu, cores, limit, args.seconds):.3f}"
            )
        elapsed = statistics.median(r[0] for r in results)
        executing = max(r[1] for r in results)
        slots = max(r[2] for r in results)
        print(
            f"hermes-gateway (median of {len(results)}): {elapsed:.3f}s ({n / elapsed:,.0f} calls/s); "
            f"ideal (limit-bound) {ideal:.3f}s"
        )
        print(
            f"max_executing={executing} (from events)  max_slots_held={slots} (sampled in Redis)  limit={limit}"
        )
        print("limit held" if max(executing, slots) <= limit else "LIMIT EXCEEDED")
        ceiling = statistics.median(cpu_ceiling(r[5], cores, limit, args.seconds) for r in results)
        print(
            f"cpu_ceiling={ceiling:.3f}  (median: the efficiency {cores} cores allow at the measured CPU per call)"
        )
        record: dict[str, Any] = {
            "bench": "io_bound",
            "commit": commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"platform": platform.platform(), "cpus": cores, "python": platform.python_version()},
            "args": vars(args),
            "rounds": [{"seconds": r[0], "efficiency": ideal / r[0], "max_executing": r[1], "max_slots_held": r[2],
                        "cpu_us_per_call": dict(zip(("client", "workers", "redis"), r[5], strict=True))} for r in results],
            "efficiency": ideal / elapsed,
            "cpu_ceiling": ceiling,
        }
        if not args.skip_rq:
            dq_elapsed = run_dramatiq(url, n, args.processes, limit, args.seconds)
            rq_elapsed = run_rq(url, n, args.processes, args.seconds)
            record.update(dramatiq_seconds=dq_elapsed, rq_seconds=rq_elapsed)
        out = RESULTS / f"io_bound-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"result: {shown(out)}")
        print(f"efficiency={ideal / elapsed:.3f}  (median; target >= 0.85)")
        if args.skip_rq:
            return
        print(
            f"Dramatiq {args.processes} processes x {max(1, limit // args.processes)} threads: {dq_elapsed:.3f}s "
            f"({n / dq_elapsed:,.0f} jobs/s)  efficiency={ideal / dq_elapsed:.3f}"
        )
        print(f"stock RQ worker-pool -n {args.processes}: {rq_elapsed:.3f}s ({n / rq_elapsed:,.0f} jobs/s)")
        print(f"ratio_vs_dramatiq={dq_elapsed / elapsed:.2f}")
        print(f"ratio_vs_rq={rq_elapsed / elapsed:.2f}")


if __name__ == "__main__":
    main()
