"""RQ 3's ``RateLimit`` against our concurrency slots, measured on the same Redis in the same run.

Issue #6 asks for RQ's ``RateLimit`` if it meets the requirements of a cluster-wide limit. This measures
what it does on the points that decide it, with stock RQ 3.0 and our stack side by side:

1. the limit across processes: 4 stock ``rq worker`` processes (``SimpleWorker``) on rate-limited jobs
   of 0.3 s with concurrency 2, and 4 of our workers on calls of 0.3 s under a limit of 2; the peak of
   jobs started at once, sampled every 10 ms (both must stay at 2);
2. a dead worker's slot: the worker running a rate-limited job is killed (SIGKILL) and the seconds
   until its slot is free again are measured, up to ``--wait`` (ours: lease ``--lease`` s);
3. submission: N rate-limited jobs (RQ refuses them in a pipeline, so one ``enqueue`` each) against
   ``Gateway.map`` of N calls under a limit, with no worker running; also whether a bound on the
   waiting jobs exists (RQ's ``rate_limited`` set has none; ours is ``queue_size``).

The last line is ``ratio_vs_rq=<our submission rate / RQ's>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    ROOT,
    Peak,
    scratch_home,
    start_workers,
    stop,
    stop_rq,
    using_broker,
    wait_for_workers,
)


def _until(check: Any, timeout: float) -> float | None:
    """Seconds until ``check()`` holds, None when it did not within ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


# -- stock RQ ------------------------------------------------------------------------------------


def _rq_workers(url: str, queue: str, n: int) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rq.cli",
                "worker",
                "--url",
                url,
                "--worker-class",
                "rq.SimpleWorker",
                "--quiet",
                queue,
            ],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(n)
    ]


def rq_limit_and_dead_slot(url: str, jobs: int, wait: float) -> tuple[int, int, float | None]:
    """(peak started, jobs run, seconds until a killed worker's slot was free or None) for stock RQ."""
    from rq import Queue
    from rq.rate_limit import RateLimit, RateLimitRegistry
    from rq.registry import StartedJobRegistry

    from broker.connection import from_url

    conn = from_url(url)
    name = f"rqrl-{uuid.uuid4().hex[:8]}"
    q = Queue(name, connection=conn)
    limit = RateLimit(f"bench-{name}", 2)
    procs = _rq_workers(url, name, 4)
    try:
        wait_for_workers(conn, 4, name, timeout=60)
        started = StartedJobRegistry(name, connection=conn)
        with Peak(lambda: started.count, 0.01) as peak:
            for _ in range(jobs):
                q.enqueue("bench.rqjobs.sleep", 0.3, rate_limit=limit)
            _until(lambda: q.finished_job_registry.count >= jobs, 120)
        finished = q.finished_job_registry.count
        # A worker dies while it runs a rate-limited job: its slot stays taken until RQ's maintenance
        # (every 10 minutes by default) finds the job abandoned after its execution expired.
        q.enqueue("bench.rqjobs.sleep", 30.0, rate_limit=limit)
        if _until(lambda: started.count >= 1, 30) is None:
            raise RuntimeError("the long job did not start")
        job_id = started.get_job_ids()[0]
        # (the job is in the started registry a moment before its hash names its worker)
        holder, deadline = None, time.monotonic() + 10
        while holder is None and time.monotonic() < deadline:
            holder = _holder(conn, job_id, procs)
            time.sleep(0.02)
        if holder is None:
            raise RuntimeError(f"no worker process found running {job_id}")
        os.kill(holder.pid, signal.SIGKILL)
        registry = RateLimitRegistry(limit.key, conn)
        back = _until(lambda: job_id not in registry.get_allowed_job_ids(), wait)
        return peak.value, finished, back
    finally:
        stop_rq(procs)


def _holder(conn: Any, job_id: str, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes] | None:
    """The RQ worker process running ``job_id`` (from the job's ``worker_name`` and the worker's pid), or None."""
    from rq import Worker
    from rq.job import Job

    name = Job.fetch(job_id, connection=conn).worker_name
    for w in Worker.all(connection=conn):
        if w.name == name:
            for p in procs:
                if p.pid == w.pid:
                    return p
    return None


def rq_submit(url: str, n: int) -> tuple[float, str]:
    """(rate-limited jobs enqueued a second, what a pipelined enqueue of one said)."""
    from rq import Queue
    from rq.rate_limit import RateLimit

    from broker.connection import from_url

    conn = from_url(url)
    q = Queue(f"rqrl-sub-{uuid.uuid4().hex[:8]}", connection=conn)
    limit = RateLimit(f"bench-sub-{q.name}", 100)
    try:  # (``Queue.prepare_data`` for ``enqueue_many`` takes no rate_limit at all)
        with conn.pipeline() as pipe:
            q.enqueue("bench.rqjobs.sleep", 0.05, rate_limit=limit, pipeline=pipe)
            pipe.execute()
        batch = "accepted"
    except ValueError as e:
        batch = f"refused: {e}"
    start = time.perf_counter()
    for _ in range(n):
        q.enqueue("bench.rqjobs.sleep", 0.05, rate_limit=limit)
    return n / (time.perf_counter() - start), batch


# -- ours ----------------------------------------------------------------------------------------


def _tool(queue: str, limit: int, queue_size: int) -> dict[str, Any]:
    return {
        "name": f"wait_{queue.replace('-', '_')}",
        "executor": "python",
        "function": "workers.executors.builtin:sleep",
        "concurrency": limit,
        "queue_size": queue_size,
        "queue": queue,
        "timeout": 120,
        "input_schema": {"type": "object", "properties": {"seconds": {"type": "number"}}},
    }


def ours_limit_and_dead_slot(url: str, jobs: int, wait: float, lease: float) -> tuple[int, int, float | None]:
    """(peak executing, calls done, seconds until a killed worker's slot was free or None) for ours."""
    from broker import keys
    from broker.codec import text
    from broker.config import load_settings
    from broker.connection import from_url
    from hermes_gateway import Gateway
    from hermes_gateway.client import BrokerHandle

    conn = from_url(url)
    queue = f"rlours-{uuid.uuid4().hex[:8]}"
    tool = _tool(queue, 2, 1000)
    home = scratch_home([tool])
    procs = start_workers(url, home, queue, 4, 8, extra_env={"HERMES_LEASE": str(lease)})
    try:
        wait_for_workers(conn, 4, queue)
        gw = Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))
        gw.sync_tools(home / "tools")
        ckey = f"tool:{tool['name']}"
        executing = lambda: conn.zcount(keys.slots(keys.tag(queue), ckey), "-inf", "(inf")  # noqa: E731 - claimed slots
        with Peak(executing, 0.01) as peak:
            handles = gw.map(tool["name"], [{"seconds": 0.3}] * jobs)
            ok = sum(1 for h in handles if h.result(120) is not None)
        long = gw.call_tool(tool["name"], {"seconds": 30.0})
        if _until(lambda: long.state == "executing", 30) is None:
            raise RuntimeError("the long call did not start")
        worker = text(conn.hget(keys.job(long.call_id), keys.F_WORKER))
        pid = int(worker.split("-")[-2]) if worker.count("-") >= 2 else -1
        victim = next(p for p in procs if p.pid == pid)
        os.kill(victim.pid, signal.SIGKILL)
        # The reaper's transition that settles the call (retrying, or failed) releases its slot in the same
        # script; the call may take a slot again at once as a new attempt.
        record = keys.job(long.call_id)
        back = _until(
            lambda: (
                conn.hget(record, keys.F_ATTEMPT) != b"1" or conn.hget(record, keys.F_STATE) != b"executing"
            ),
            wait,
        )
        long.cancel()
        gw.close()
        return peak.value, ok, back
    finally:
        stop(procs)


def ours_submit(url: str, n: int) -> tuple[float, str]:
    """(calls submitted a second through ``Gateway.map`` under a limit, what one more than queue_size got)."""
    from broker.config import load_settings
    from broker.connection import from_url
    from hermes_gateway import Gateway
    from hermes_gateway.client import BrokerHandle

    queue = f"rlsub-{uuid.uuid4().hex[:8]}"
    tool = _tool(queue, 100, n - 100)  # room for exactly n: 100 on slots, n - 100 waiting
    home = scratch_home([tool])
    gw = Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))
    gw.sync_tools(home / "tools")
    start = time.perf_counter()
    batch = gw.map(tool["name"], [{"seconds": 0.05}] * n)
    rate = n / (time.perf_counter() - start)
    more = gw.map(tool["name"], [{"seconds": 0.05}])
    refused = more.refused[0][1].refused if more.refused else None
    for h in batch:
        h.cancel()
    gw.close()
    return rate, (type(refused).__name__ + f": {refused}") if refused else "accepted (no bound)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--calls", type=int, default=2000, help="calls submitted in part 3")
    parser.add_argument("--jobs", type=int, default=20, help="0.3 s jobs run under a limit of 2 in part 1")
    parser.add_argument("--wait", type=float, default=30.0, help="how long to wait for a dead worker's slot")
    parser.add_argument("--lease", type=float, default=3.0, help="our workers' lease (seconds)")
    parser.add_argument("--url", default=None, help="Redis URL (default $HERMES_REDIS_URL, else embedded)")
    args = parser.parse_args()
    with using_broker(args.url) as url:
        print(f"broker: {url}")
        rq_peak, rq_ran, rq_back = rq_limit_and_dead_slot(url, args.jobs, args.wait)
        our_peak, our_ran, our_back = ours_limit_and_dead_slot(url, args.jobs, args.wait, args.lease)
        print(
            f"1. limit 2 across 4 processes, {args.jobs} jobs of 0.3 s: "
            f"RQ RateLimit peak started={rq_peak} (ran {rq_ran}); ours peak executing={our_peak} (ran {our_ran})"
        )

        def secs(v: float | None) -> str:
            return f"{v:.1f}s" if v is not None else f"not within {args.wait:g}s"

        print(
            f"2. slot of a worker killed mid-job free again after: RQ RateLimit {secs(rq_back)}; "
            f"ours {secs(our_back)} (lease {args.lease:g}s; RQ frees it when a worker's maintenance, every "
            f"600 s by default, finds the job's execution expired)"
        )
        rq_rate, rq_batch = rq_submit(url, args.calls)
        our_rate, our_bound = ours_submit(url, args.calls)
        print(
            f"3. submitting {args.calls:,} under a limit of 100: RQ RateLimit {rq_rate:,.0f} jobs/s "
            f"(one enqueue each; in a pipeline: {rq_batch}); ours {our_rate:,.0f} calls/s (one pipelined map)"
        )
        print(
            f"   one past the waiting bound: RQ RateLimit has none (its rate_limited set grows); ours: {our_bound}"
        )
        print(f"ratio_vs_rq={our_rate / rq_rate:.2f}")


if __name__ == "__main__":
    main()
