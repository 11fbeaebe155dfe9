"""The batch submitter's memory: peak RSS of a process running ``gw.batch`` over N items (a generator, the
default window) to its end, for several N, each in a fresh process; the slope per item extrapolates to
1,000,000 items (goal: at most 200 MB). A handle-per-item submitter (``gw.map``) grows ~3.7 KB an item.

    python bench/batch_rss.py [--url redis://...] [--counts 2000,10000,20000]

Measured (2 workers, 100 threads each, a no-op tool; the machine shared with other jobs, so the seconds
are noisy, the memory is not): peak 48.5 MB at 2,000, 10,000 and 20,000 items alike (base 47.4 MB after
imports and connecting): ~0.5 byte an item, extrapolated 49 MB for 1,000,000.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, scratch_home, start_workers, stop, using_broker, wait_for_workers  # noqa: E402

NOOP = {"name": "noop", "executor": "python", "function": "workers.executors.builtin:noop", "timeout": 10,
        "concurrency": 200, "queue_size": 10000}


def child(url: str, home: str, n: int) -> None:
    """Run one batch of ``n`` items here; print {"n", "base_mb", "peak_mb", "seconds"} as JSON."""
    import psutil

    from hermes_gateway.client import Gateway

    me = psutil.Process()
    gw = Gateway.connect(url, home=home, embedded_ok=False, check_workers=False)
    gw.sync_tools()
    base = me.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    started = time.perf_counter()
    job = gw.batch("noop", ({"i": i} for i in range(n)))
    progress = job.wait()
    seconds = time.perf_counter() - started
    done.set()
    peak[0] = max(peak[0], me.memory_info().rss)
    assert progress.counts.get("done") == n, progress
    print(json.dumps({"n": n, "base_mb": base / 2**20, "peak_mb": peak[0] / 2**20, "seconds": round(seconds, 2)}))
    gw.close()


def measure(url: str, counts: list[int]) -> dict[str, Any]:
    """Peak RSS of a fresh submitter process per batch size in ``counts`` (2 workers), and the slope per
    item extrapolated to 1,000,000 items."""
    import redis

    home = scratch_home([NOOP])
    procs = start_workers(url, home, "tools", 2, 100)
    rows = []
    try:
        wait_for_workers(redis.Redis.from_url(url), 2, "tools")
        for n in counts:
            out = subprocess.run([sys.executable, "-m", "bench.batch_rss", "--child", url, str(home), str(n)],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row))
    finally:
        stop(procs)
    first, last = rows[0], rows[-1]
    slope = (last["peak_mb"] - first["peak_mb"]) / max(1, last["n"] - first["n"])  # MB per item
    return {
        "rows": rows,
        "bytes_per_item": round(slope * 2**20, 1),
        "extrapolated_peak_mb_1m": round(last["peak_mb"] + max(0.0, slope) * 1_000_000, 1),
        "goal_mb": 200,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=None)
    parser.add_argument("--counts", default="2000,10000,30000")
    parser.add_argument("--child", nargs=3, metavar=("URL", "HOME", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    with using_broker(args.url) as url:
        out = measure(url, [int(x) for x in args.counts.split(",")])
    print(f"bytes_per_item={out['bytes_per_item']:.1f}")
    print(f"extrapolated_peak_mb_1m={out['extrapolated_peak_mb_1m']:.1f}")


if __name__ == "__main__":
    main()
