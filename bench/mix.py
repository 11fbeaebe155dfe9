"""Interactive latency beside a batch on the same tool: what fair dispatch buys (issue #29).

One tool (concurrency ``--limit`` 8, a Python tool sleeping ``--tool-ms`` 5 ms), warm worker processes.
1. *alone*: ``--samples`` interactive calls one after another (``call_tool(...).result()``), nothing else.
2. *behind*: the same while a batch of ``--items`` calls runs on the same tool, ``gw.batch`` in a process
   of its own (class ``batch``, the batch id its fairness key), at most ``--window`` of them unfinished
   (so the tool always has a backlog of waiting batch calls, and the submitter's memory stays bounded).
3. *fifo* (the reference): a few calls submitted as if they were part of the batch (its key and class),
   which is where every call waited before fair dispatch: behind the whole backlog.
4. *peers* (``--peers``): the same on Dramatiq and stock RQ (see "peers" below): alone, behind the batch in a
   queue of their own that the workers prefer (how their users would put an agent first), and in the
   batch's queue.
Latency is submit → ``done`` event at the caller; "to start" is submit → ``routing`` (the slot wait and
the worker's pick-up), the part fair dispatch decides. The machine is shared: figures are noisy, ratios count.
5. *memory* (unless ``--no-memory``): Redis bytes per finished call (bench/memory.py, goal <= 800), the
   batch submitter's peak RSS extrapolated to 1,000,000 items (bench/batch_rss.py, goal <= 200 MB), and
   with ``--soak 600`` ten minutes at full speed with ``result_ttl: 60`` (used_memory flat).
The last line is ``interactive_slowdown=<p99 behind / p99 alone>`` (goal <= 2); each p99 is read from
1,000 calls (the 10th slowest: from 200, the 2nd or 3rd slowest, a ratio of two such moved by ±0.4 from
run to run). A JSON result goes to
``bench/results/mix-<UTC time>.json``. Workers run as users run them (no ``keep_history``): the wait for a
slot comes from the ``steps`` an ended call's terminal event keeps.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from queue import Empty
from typing import Any

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

SLEEP = "workers.executors.builtin:sleep"
RESULT_TTL = 30  # seconds the latency phases' ended calls are kept (they would otherwise fill the Redis)
BATCH_TTL = 900  # seconds the batch (its counters and results) is kept: past the run, not a day


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered) * 1e3, p99 * 1e3


def interactive(gw: Any, name: str, n: int, seconds: float, waits: list[float] | None = None, **opts: Any) -> list[float]:
    """Latency of ``n`` calls made one after another, in seconds; with ``waits``, each call's time from its
    ``pending`` event to its ``routing`` one (waiting for a slot, then for a worker to take it) is added."""
    from broker import events

    out = []
    for _ in range(n):
        start = time.perf_counter()
        handle = gw.call_tool(name, {"seconds": seconds}, **opts)
        handle.result(300)
        out.append(time.perf_counter() - start)
        if waits is not None:  # from the moves its kept terminal event carries: [state, attempt, µs before the end, seq]
            end = events.history(gw.conn, handle.call_id)[-1]
            before = {step[0]: step[2] for step in end.steps or []}
            waits.append((before["pending"] - before["routing"]) / 1e6)
    return out


def run_batch(url: str, home: str, name: str, items: int, window: int, seconds: float, out: Any) -> None:
    """Run ``items`` calls as a batch, ``gw.batch`` as users run one (its submitter keeps at most ``window``
    unfinished and follows the batch's counters, not each call's events); puts the batch id, then the
    seconds it took (run in a process of its own: a submitter thread beside the interactive caller would
    share its interpreter lock)."""
    from broker.config import load_settings
    from broker.connection import BrokerHandle, from_url
    from hermes_gateway import Gateway

    gw = Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))
    start = time.perf_counter()
    job = gw.batch(name, ({"seconds": seconds} for _ in range(items)), window=window, ttl=BATCH_TTL)
    out.put(job.id)
    progress = job.wait()
    if progress.counts.get("done", 0) != items:
        raise RuntimeError(f"the batch did not end done: {progress.counts}")
    out.put(time.perf_counter() - start)
    gw.close()


def backlog(conn: Any, queue: str, name: str) -> int:
    from broker import keys

    tag, ckey = keys.tag(queue), f"tool:{name}"
    return int(conn.zcard(keys.waiting(tag, ckey))) + int(conn.zcard(keys.waiting_batch(tag, ckey)))


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from broker.config import load_settings
    from broker.connection import BrokerHandle, from_url
    from hermes_gateway import Gateway

    queue = f"mix-{uuid.uuid4().hex[:8]}"
    name = f"sleep_{queue.replace('-', '_')}"
    seconds = args.tool_ms / 1000
    tool = {
        "name": name,
        "executor": "python",
        "function": SLEEP,
        "concurrency": args.limit,
        "queue_size": args.window + 1000,
        "queue": queue,
    }
    home = scratch_home([tool])
    conn = from_url(url)
    # Finished calls are kept a short while only: the batch's records would otherwise fill the Redis.
    procs = start_workers(url, home, queue, args.processes, args.concurrency, {"HERMES_RESULT_TTL": str(RESULT_TTL)})
    try:
        wait_for_workers(conn, args.processes, queue)
        gw = Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))
        gw.sync_tools(home / "tools")
        interactive(gw, name, 50, seconds, fairness_key="warm-up")
        waits_alone: list[float] = []
        alone = interactive(gw, name, args.samples, seconds, waits_alone, fairness_key="agent")
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        batch = ctx.Process(target=run_batch, args=(url, str(home), name, args.items, args.window, seconds, out))
        batch.start()
        batch_id = out.get(timeout=60)  # (its calls' fairness key)
        deadline = time.monotonic() + 60
        while backlog(conn, queue, name) < min(args.window // 2, args.items // 2) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the batch has a backlog of waiting calls
        depth = backlog(conn, queue, name)
        waits_behind: list[float] = []
        behind = interactive(gw, name, args.samples, seconds, waits_behind, fairness_key="agent")
        fifo = interactive(gw, name, args.fifo_samples, seconds, None, fairness_key=batch_id, call_class="batch")
        depth_after = backlog(conn, queue, name)
        elapsed = None
        while elapsed is None:
            try:
                elapsed = out.get(timeout=1)
            except Empty:
                if not batch.is_alive():
                    raise RuntimeError(f"the batch submitter died (exit code {batch.exitcode})") from None
        batch.join()
        gw.close()
    finally:
        stop(procs)
    p50_alone, p99_alone = percentiles(alone)
    p50_behind, p99_behind = percentiles(behind)
    p50_fifo, p99_fifo = percentiles(fifo) if fifo else (0.0, 0.0)
    wa, wb = percentiles(waits_alone), percentiles(waits_behind)
    return {
        "alone_ms": {"p50": p50_alone, "p99": p99_alone},
        "behind_ms": {"p50": p50_behind, "p99": p99_behind},
        "to_start_ms": {"alone": {"p50": wa[0], "p99": wa[1]}, "behind": {"p50": wb[0], "p99": wb[1]}},
        "fifo_ms": {"p50": p50_fifo, "p99": p99_fifo, "samples": len(fifo)},
        "batch_backlog": {"when_measuring": depth, "after": depth_after},
        "batch_calls_per_s": args.items / elapsed,
        "interactive_slowdown": p99_behind / p99_alone,
    }


# -- peers ------------------------------------------------------------------------------------------------
# The same scenario on Dramatiq (1 process x --limit threads, bench/dramatiq_results.py) and stock RQ (--limit
# SimpleWorker processes, bench/rqjobs.py): a job sleeping --tool-ms, its result waited for as each one's
# users wait (Dramatiq's Results middleware, RQ's ``latest_result``), a batch backlog of --window jobs kept
# by a process of its own. Neither has a fair share between callers, so an agent's call either joins the
# batch's queue (*same queue*: FIFO behind the backlog) or, as their users would set it up, goes to a queue
# of its own that the workers prefer (*own queue*: RQ's queue order; Dramatiq's own consumer and priority).


def peer_backlog(conn: Any, kind: str, queue: str) -> int:
    """A peer's unfinished jobs on ``queue``: Dramatiq's messages not yet acked (queued, fetched or running),
    RQ's jobs still queued."""
    return int(conn.hlen(f"dramatiq:{queue}.msgs") if kind == "dramatiq" else conn.llen(f"rq:queue:{queue}"))


def peer_batch(kind: str, url: str, queue: str, first: str, window: int, seconds: float, stop_flag: Any, out: Any) -> None:
    """Keep ``window`` unfinished batch jobs of ``kind`` on ``queue`` until ``stop_flag`` is set; puts how
    many it sent (a process of its own, as ours: a thread would share the measuring caller's lock)."""
    from broker.connection import from_url

    conn = from_url(url)
    send: Any
    if kind == "dramatiq":
        actors = dramatiq_results(url, queue, first)

        def send(n: int) -> None:
            for _ in range(n):
                actors.batch_sleep.send(seconds)
    else:
        from rq import Queue

        q = Queue(queue, connection=conn)

        def send(n: int) -> None:
            q.enqueue_many([Queue.prepare_data("bench.rqjobs.sleep", (seconds,), result_ttl=RESULT_TTL) for _ in range(n)])

    sent = 0
    while not stop_flag.is_set():
        missing = window - peer_backlog(conn, kind, queue)
        if missing > 0:
            send(min(missing, 500))
            sent += min(missing, 500)
        else:
            time.sleep(0.02)
    out.put(sent)


def peer_calls(kind: str, target: Any, n: int, seconds: float) -> list[float]:
    """Latency of ``n`` jobs made one after another, each waited for to its result, in seconds (``target``:
    the Dramatiq actor to send, or the RQ queue to enqueue on)."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        if kind == "dramatiq":
            target.send(seconds).get_result(block=True, timeout=300_000)
        else:
            job = target.enqueue("bench.rqjobs.sleep", seconds, result_ttl=RESULT_TTL)
            if job.latest_result(timeout=300) is None:
                raise RuntimeError(f"stock RQ gave no result for {job.id} in 300 s")
        out.append(time.perf_counter() - start)
    return out


def run_peer(kind: str, args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Alone, behind the batch in a queue of its own, and in the batch's queue: one peer's figures."""
    from redis import Redis
    from rq import Queue

    from broker.connection import from_url

    tag = uuid.uuid4().hex[:8]
    queue, first = f"mix-{kind}-{tag}", f"mix-{kind}-{tag}-first"
    seconds = args.tool_ms / 1000
    conn = from_url(url)
    if kind == "dramatiq":
        actors = dramatiq_results(url, queue, first)
        procs = start_dramatiq(url, queue, first, args.limit)
        own: Any = actors.first_sleep
        same: Any = actors.batch_sleep
    else:
        procs = start_rq_workers(url, first, args.limit, queue)  # (the agent's queue first: RQ's priority)
        # (no socket timeout: redis-py 8's default of 5 s would cut RQ's blocking wait for a later result)
        waits = Redis.from_url(url, socket_timeout=None)
        own, same = Queue(first, connection=waits), Queue(queue, connection=waits)
    ctx = multiprocessing.get_context("spawn")
    stop_flag, out = ctx.Event(), ctx.Queue()
    batch = ctx.Process(target=peer_batch, args=(kind, url, queue, first, args.window, seconds, stop_flag, out))
    try:
        if kind == "rq":
            wait_for_workers(conn, args.limit, first, timeout=60)
        peer_calls(kind, own, 20, seconds)  # warm
        alone = peer_calls(kind, own, args.peer_samples, seconds)
        batch.start()
        deadline = time.monotonic() + 60
        while peer_backlog(conn, kind, queue) < args.window // 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the batch has a backlog
        depth = peer_backlog(conn, kind, queue)
        behind = peer_calls(kind, own, args.peer_samples, seconds)
        fifo = peer_calls(kind, same, args.peer_fifo_samples, seconds)
        stop_flag.set()
        sent = out.get(timeout=60)
        batch.join(30)
    finally:
        stop_flag.set()
        if batch.is_alive():
            batch.terminate()
        (stop_rq if kind == "rq" else stop)(procs)
        for key in conn.scan_iter(f"*{tag}*"):
            conn.delete(key)
        conn.close()
    (a50, a99), (b50, b99) = percentiles(alone), percentiles(behind)
    return {
        "alone_ms": {"p50": a50, "p99": a99},
        "behind_ms": {"p50": b50, "p99": b99},
        "fifo_ms": {"p50": percentiles(fifo)[0], "samples": len(fifo)},
        "batch_backlog": depth,
        "batch_sent": sent,
        "interactive_slowdown": b99 / a99,
    }


def memory(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """The bounded-memory figures of the same run: Redis bytes per finished call (bench/memory.py), the
    batch submitter's peak RSS extrapolated to 1,000,000 items (bench/batch_rss.py) and, with ``--soak``,
    used_memory over that many seconds at full speed with ``result_ttl: 60``."""
    from bench import batch_rss
    from bench import memory as mem
    from broker.connection import from_url

    # The latency phases' records expire 30 s after their calls ended (HERMES_RESULT_TTL): measured
    # while they go, used_memory would fall under the new calls. Wait until the key count is still.
    conn = from_url(url)
    time.sleep(RESULT_TTL)
    before, after = -1, conn.dbsize()
    while after != before:
        time.sleep(2)
        before, after = after, conn.dbsize()
    conn.close()
    out: dict[str, Any] = {"redis_bytes": mem.bytes_per_call(url, 5000)}
    out["submitter_rss"] = batch_rss.measure(url, [2000, 10000, 30000])
    if args.soak:
        soaked = mem.soak(url, args.soak)
        soaked.pop("samples")
        out["soak"] = soaked
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000, help="calls in the batch")
    parser.add_argument("--window", type=int, default=5_000, help="batch calls unfinished at most (its backlog)")
    parser.add_argument("--samples", type=int, default=1000, help="interactive calls per phase (p99 = the 10th slowest)")
    parser.add_argument("--fifo-samples", type=int, default=5, help="calls queued as part of the batch (reference)")
    parser.add_argument("--limit", type=int, default=8, help="the tool's concurrency")
    parser.add_argument("--tool-ms", type=float, default=5.0, help="how long the tool runs")
    parser.add_argument("--processes", type=int, default=1, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=16, help="threads per worker process")
    parser.add_argument("--url", default=None, help="Redis URL (default $HERMES_REDIS_URL, else embedded)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory figures (bytes per call, RSS)")
    parser.add_argument("--soak", type=float, default=0.0, help="seconds of a soak at full speed (result_ttl 60); the issue's run: 600")
    parser.add_argument("--no-save", action="store_true", help="do not write the JSON result")
    parser.add_argument("--peers", default="dramatiq,rq", help="peer queues run the same way ('' for none)")
    parser.add_argument("--peer-samples", type=int, default=None,
                        help="a peer's calls alone and behind the batch (default: --samples, as ours)")
    parser.add_argument("--peer-fifo-samples", type=int, default=3, help="a peer's calls in the batch's own queue")
    args = parser.parse_args()
    with using_broker(args.url) as url:
        print(f"broker: {url}; tool limit {args.limit}, {args.tool_ms:g} ms; batch of {args.items:,} "
              f"(window {args.window:,}); {args.samples} interactive calls per phase (a shared machine is noisy)")
        result = run(args, url)
        peers = [p for p in args.peers.split(",") if p]
        args.peer_samples = args.peer_samples or args.samples  # (p99s from as many calls as ours)
        result["peers"] = {kind: run_peer(kind, args, url) for kind in peers}
        if not args.no_memory:
            result["memory"] = memory(args, url)
    a, b, f = result["alone_ms"], result["behind_ms"], result["fifo_ms"]
    print(f"interactive alone:        p50 {a['p50']:.1f} ms  p99 {a['p99']:.1f} ms")
    depth = result["batch_backlog"]
    print(f"interactive behind batch: p50 {b['p50']:.1f} ms  p99 {b['p99']:.1f} ms  "
          f"(batch backlog {depth['when_measuring']:,} waiting, {depth['after']:,} after)")
    w = result["to_start_ms"]
    print(f"submit -> a worker starts it: alone p50 {w['alone']['p50']:.1f} / p99 {w['alone']['p99']:.1f} ms, "
          f"behind p50 {w['behind']['p50']:.1f} / p99 {w['behind']['p99']:.1f} ms")
    if f["samples"]:
        print(f"queued as part of the batch (FIFO, as before fair dispatch): p50 {f['p50']:.1f} ms")
    print(f"batch: {result['batch_calls_per_s']:,.0f} calls/s")
    names = {"dramatiq": f"Dramatiq 1x{args.limit}", "rq": f"stock RQ, {args.limit} SimpleWorkers"}
    for kind, peer in result["peers"].items():
        a, b, f = peer["alone_ms"], peer["behind_ms"], peer["fifo_ms"]
        print(f"{names[kind]}: alone p50 {a['p50']:.1f} / p99 {a['p99']:.1f} ms; behind the batch "
              f"({peer['batch_backlog']:,} unfinished) in a queue of its own p50 {b['p50']:.1f} / p99 {b['p99']:.1f} ms "
              f"(slowdown {peer['interactive_slowdown']:.2f}), in the batch's queue p50 {f['p50']:.1f} ms")
    if "memory" in result:
        m = result["memory"]
        rb, rss = m["redis_bytes"], m["submitter_rss"]
        print(f"Redis per finished call: {rb['bytes_per_call']:.0f} bytes (used_memory delta less the audit stream's), "
              f"{rb['record_bytes']} bytes MEMORY USAGE of one (goal <= 800)")
        print(f"batch submitter: {rss['bytes_per_item']:.1f} bytes an item, peak "
              f"{rss['extrapolated_peak_mb_1m']:.0f} MB extrapolated to 1,000,000 items (goal <= 200)")
        if "soak" in m:
            k = m["soak"]
            print(f"soak {k['seconds']:.0f} s at {k['calls_per_s']:,.0f} calls/s, result_ttl 60: used_memory less the "
                  f"audit stream {k['without_audit_start']:,} at the start, {k['without_audit_after_ttl_min']:,}.."
                  f"{k['without_audit_after_ttl_max']:,} after the first ttl, {k['without_audit_end']:,} at the end")
    if not args.no_save:
        out = RESULTS / f"mix-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "bench": "mix",
            "commit": commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "args": vars(args),
            **result,
        }
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"result: {shown(out)}")
    print(f"interactive_slowdown={result['interactive_slowdown']:.2f}")


if __name__ == "__main__":
    main()
