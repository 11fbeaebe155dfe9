"""One call at a time: the latency a caller sees, our stack against stock RQ on the same Redis.

Ours: ``Gateway.call_tool(...).result()`` of a no-op tool (submit, then wait for the ``done`` event).
RQ: ``enqueue`` of a no-op job, then ``Job.latest_result(timeout=...)`` (RQ 3's blocking read of the job's
result stream). One warm worker process each, nothing else in flight; p50 and p99 of ``--calls`` calls.
The last line is ``p50_ratio_vs_rq=<x>`` (ours / RQ: below 1 is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import scratch_home, start_rq_workers, start_workers, stop, using_broker, wait_for_workers  # noqa: E402

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
        stop(procs)
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="Redis URL (default: $HERMES_REDIS_URL, else an embedded broker)")
    parser.add_argument("-n", "--calls", type=int, default=500)
    args = parser.parse_args()
    with using_broker(args.url) as url:
        ours = percentiles(run_ours(url, args.calls))
        rq = percentiles(run_rq(url, args.calls))
    print(f"{args.calls} sequential no-op calls after {WARM} warm-up, one worker process each")
    print(f"ours:     p50 {ours[0]:.2f} ms  p99 {ours[1]:.2f} ms")
    print(f"stock RQ: p50 {rq[0]:.2f} ms  p99 {rq[1]:.2f} ms")
    print(f"p99_ratio_vs_rq={ours[1] / rq[1]:.3f}")
    print(f"p50_ratio_vs_rq={ours[0] / rq[0]:.3f}")


if __name__ == "__main__":
    main()
