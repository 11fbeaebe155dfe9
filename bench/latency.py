"""One call at a time: the latency a caller sees, our stack beside Dramatiq and stock RQ on the same Redis.

Ours: ``Gateway.call_tool(...).result()`` of a no-op tool (submit, then wait for the ``done`` event), one
worker process with 8 call slots. Dramatiq: ``send`` of a no-op actor, then ``message.get_result(block=True)``
(its ``Results`` middleware on a Redis backend), one process with 8 threads. RQ: ``enqueue`` of a no-op job,
then ``Job.latest_result(timeout=...)`` (RQ 3's blocking read of the job's result stream), one
``SimpleWorker``. Nothing else in flight; p50 and p99 of ``--calls`` calls each. The JSON result goes to
``bench/results/latency-<UTC time>.json``; the last line is ``p50_ratio_vs_rq=<x>`` (ours / RQ: below 1 is
faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS,
    commit,
    dramatiq_results,
    scratch_home,
    shown,
    start_dramatiq,
    start_rq_workers,
    start_workers,
    stop,
    stop_rq,
    using_broker,
    wait_for_workers,
)

WARM = 50


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered) * 1e3, p99 * 1e3


def run_ours(url: str, n: int) -> list[float]:
    from broker.config import load_settings
    from broker.connection import BrokerHandle, from_url
    from hermes_gateway import Gateway

    queue = f"lat-{uuid.uuid4().hex[:8]}"
    name = f"noop_{queue.replace('-', '_')}"
    tool = {"name": name, "executor": "python", "function": "workers.executors.builtin:noop", "queue": queue}
    home = scratch_home([tool])
    conn = from_url(url)
    procs = start_workers(url, home, queue, 1, 8)
    try:
        wait_for_workers(conn, 1, queue)
        gw = Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))
        gw.sync_tools(home / "tools")
        samples = []
        for i in range(WARM + n):
            start = time.perf_counter()
            gw.call_tool(name, {}).result(30)
            if i >= WARM:
                samples.append(time.perf_counter() - start)
        gw.close()
        return samples
    finally:
        stop(procs)
        conn.close()


def run_rq(url: str, n: int) -> list[float]:
    from redis import Redis
    from rq import Queue

    conn = Redis.from_url(url)
    name = f"rqlat-{uuid.uuid4().hex[:8]}"
    q = Queue(name, connection=conn)
    procs = start_rq_workers(url, name, 1)
    try:
        wait_for_workers(conn, 1, name)
        samples = []
        for i in range(WARM + n):
            start = time.perf_counter()
            job = q.enqueue("bench.rqjobs.noop")
            result = job.latest_result(timeout=30)
            if result is None or result.type != result.Type.SUCCESSFUL:
                raise RuntimeError(f"RQ job {job.id} did not succeed: {result}")
            if i >= WARM:
                samples.append(time.perf_counter() - start)
        return samples
    finally:
        stop_rq(procs)
        conn.close()


def run_dramatiq(url: str, n: int) -> list[float]:
    from broker.connection import from_url

    tag = uuid.uuid4().hex[:8]
    queue, first = f"dqlat-{tag}", f"dqlat-{tag}-first"
    actors = dramatiq_results(url, queue, first)
    procs = start_dramatiq(url, queue, first, 8)
    conn = from_url(url)
    try:
        samples = []
        for i in range(WARM + n):  # (the first waits for the worker to start)
            start = time.perf_counter()
            actors.first_sleep.send(0.0).get_result(block=True, timeout=60_000)
            if i >= WARM:
                samples.append(time.perf_counter() - start)
        return samples
    finally:
        stop(procs)
        for key in conn.scan_iter(f"*{tag}*"):
            conn.delete(key)
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="Redis URL (default: $HERMES_REDIS_URL, else an embedded broker)")
    parser.add_argument("-n", "--calls", type=int, default=500)
    parser.add_argument("--no-save", action="store_true", help="do not write the JSON result")
    args = parser.parse_args()
    with using_broker(args.url) as url:
        ours = percentiles(run_ours(url, args.calls))
        dq = percentiles(run_dramatiq(url, args.calls))
        rq = percentiles(run_rq(url, args.calls))
    print(f"{args.calls} sequential no-op calls after {WARM} warm-up, one worker process each")
    print(f"ours:     p50 {ours[0]:.2f} ms  p99 {ours[1]:.2f} ms")
    print(f"Dramatiq: p50 {dq[0]:.2f} ms  p99 {dq[1]:.2f} ms")
    print(f"stock RQ: p50 {rq[0]:.2f} ms  p99 {rq[1]:.2f} ms")
    if not args.no_save:
        out = RESULTS / f"latency-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        figures = {name: {"p50_ms": p[0], "p99_ms": p[1]} for name, p in (("ours", ours), ("dramatiq", dq), ("rq", rq))}
        record = {
            "bench": "latency",
            "commit": commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "calls": args.calls,
            **figures,
        }
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"result: {shown(out)}")
    print(f"p50_ratio_vs_dramatiq={ours[0] / dq[0]:.3f}")
    print(f"p99_ratio_vs_rq={ours[1] / rq[1]:.3f}")
    print(f"p50_ratio_vs_rq={ours[0] / rq[0]:.3f}")


if __name__ == "__main__":
    main()
