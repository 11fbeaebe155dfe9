"""Fleet-wide rate limits against the fake OpenAI-compatible server (``tests/llm_server``): 4 worker
processes x 8 slots, a model limited to 600 requests/min and 60,000 tokens/min.

Figures, counted where the provider counts (the server's receive times):
- ``max_in_window``: the most requests in any sliding window (goal <= the limit: no overshoot);
- ``utilisation``: requests received over whole windows while work waited / what the limit allows
  (goal >= 0.95);
- ``sent_during_pause``: after one scripted 429 with ``Retry-After: 2`` (the fleet otherwise idle, then a
  batch submitted), requests that reached the server before the pause ended, the 429's own not counted
  (goal 0).

``--seconds`` under 130 runs a scaled-down limit (10 requests per second, the limiter's 1 s window)
for a quick run; the default runs the per-minute limit over ``--seconds`` (at least two windows).
Results go to ``bench/results/rate_limits-<date>.json``; the last line is a ratio/goal summary.

    python bench/rate_limits.py [--seconds 150] [--redis URL]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

from bench.common import RESULTS, ROOT, scratch_home, start_workers, stop, using_broker, wait_for_workers  # noqa: E402
from tests.llm_server import LLMServer, Reply  # noqa: E402

MODEL, PAUSE_MODEL = "steady-model", "pause-model"
ASK = [{"role": "user", "content": "Say something"}]


def most_in_window(times: list[float], window: float) -> int:
    times = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while times[lo] <= t - window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def steady(gw: Any, server: LLMServer, per_window: int, window: float, seconds: float) -> dict[str, Any]:
    """Keep more work waiting than the limit allows for ``seconds``; what the server received."""
    n = int(per_window * (seconds / window + 1) * 1.2)
    handles = [gw.call_llm({"messages": ASK, "max_tokens": 50, "model": MODEL}) for _ in range(n)]
    start = time.time()
    time.sleep(seconds)
    for h in handles:
        h.cancel()
    got = sorted(r.received for r in server.chat_requests if (r.body or {}).get("model") == MODEL)
    windows = int((got[-1] - got[0]) // window) if got else 0
    whole = [t for t in got if t < got[0] + windows * window] if windows else []
    return {
        "submitted": n,
        "received": len(got),
        "seconds": round(time.time() - start, 1),
        "max_in_window": most_in_window(got, window),
        "whole_windows": windows,
        "utilisation": round(len(whole) / (windows * per_window), 4) if windows else None,
    }


def pause(gw: Any, server: LLMServer, batch: int) -> dict[str, Any]:
    """One 429 with Retry-After: 2, then a batch: how many requests reach the server before it ends."""
    from broker.ratelimits import RateLimiter

    server.script(Reply(status=429, error="slow down", headers={"Retry-After": "2"}))
    first = gw.call_llm({"messages": ASK, "max_tokens": 50, "model": PAUSE_MODEL})
    limiter = RateLimiter(gw.conn)
    deadline = time.monotonic() + 10
    until = None
    while until is None and time.monotonic() < deadline:
        rows = [r for r in limiter.snapshot(["llm"]) if r["key"] == f"llm:{PAUSE_MODEL}" and r["paused_until"]]
        until = rows[0]["paused_until"] if rows else None
        time.sleep(0.01)
    if until is None:
        raise RuntimeError("the 429 did not pause the key")
    handles = [gw.call_llm({"messages": ASK, "max_tokens": 50, "model": PAUSE_MODEL}) for _ in range(batch)]
    done = sum(1 for h in [first, *handles] if h.result(60))
    got = sorted(r.received for r in server.chat_requests if (r.body or {}).get("model") == PAUSE_MODEL)
    return {
        "calls": batch + 1,
        "done": done,
        "received": len(got),
        "pause_s": round(until - got[0], 3),
        "sent_during_pause": sum(1 for t in got[1:] if t < until),
        "first_after_pause_s": round(got[1] - until, 3) if len(got) > 1 else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=150.0, help="the steady phase (under 130: scaled down)")
    ap.add_argument("--redis", help="Redis URL (default: $HERMES_REDIS_URL, else an embedded broker)")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args()
    quick = args.seconds < 130
    per_window, window = (10, 1.0) if quick else (600, 60.0)
    limit = {"requests_per_second": 10} if quick else {"requests_per_minute": 600}
    limit["tokens_per_minute"] = 60_000
    with LLMServer(api_key="sk-bench", model=MODEL) as server, using_broker(args.redis) as url:
        redis.Redis.from_url(url).flushdb()
        home = scratch_home(
            [],
            {
                "model": {
                    "provider": "openai-compatible", "base_url": server.base_url, "api_key": "sk-bench",
                    "model": MODEL, "max_retries": 0, "rate_limits": {MODEL: limit, PAUSE_MODEL: limit},
                },
                "executors": {"llm": {"concurrency": args.processes * args.slots}},
            },
        )
        from hermes_gateway.client import Gateway

        procs = start_workers(url, home, "llm", args.processes, args.slots)
        gw = Gateway.connect(url, home=str(home), embedded_ok=False, check_workers=False)
        try:
            wait_for_workers(gw.conn, args.processes, "llm")
            figures = {"steady": steady(gw, server, per_window, window, args.seconds)}
            figures["pause"] = pause(gw, server, 3 * per_window if quick else 40)
        finally:
            gw.close()
            stop(procs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {
        "bench": "rate_limits", "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
        "limit": limit, "window_s": window, "per_window": per_window, "processes": args.processes,
        "slots": args.slots, **figures,
    }
    out = RESULTS / f"rate_limits-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    s, p = figures["steady"], figures["pause"]
    print(
        f"max_in_window={s['max_in_window']}/{per_window} (goal <= {per_window}) "
        f"utilisation={s['utilisation']} (goal >= 0.95) "
        f"sent_during_pause={p['sent_during_pause']} (goal 0)"
    )


if __name__ == "__main__":
    main()
