"""Redis memory per finished call, and a soak at full speed (issue 29, "bounded memory").

Bytes per call: after a warm-up, N no-op calls with 100 bytes of arguments are run to their end; the
figure is the growth of ``used_memory`` over N, less the growth of the audit stream and its index
(capped at ``audit.maxlen`` entries, counted apart), beside ``MEMORY USAGE`` of one ended call's own keys
(its job hash and its history). The goal is <= 800 bytes.

Soak (``--soak SECONDS``): calls at full speed with ``workers.result_ttl: 60``; ``used_memory`` at the
start, every few seconds, and at the end should be flat once the first minute's records expire (the audit
stream grows until its cap, so the figures are also given without it).

Beside it (unless ``--no-peers``), the same on Dramatiq (1 process x 8 threads, its ``Results`` middleware
on Redis: what a finished message keeps is its result) and stock RQ (one ``SimpleWorker``; a finished job
keeps its hash, its result stream and its place in the finished registry for ``result_ttl``, 500 s by
default): ``used_memory`` growth over their N finished jobs, the same 100-byte arguments.

Results go to ``bench/results/memory.json`` (and ``memory-soak.json``) with the commit, date and machine.
The machine is shared: speeds are noisy, byte counts are not.

    python bench/memory.py [-n 5000] [--soak 600] [--url redis://...] [--no-peers]
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS,
    ROOT,
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

ARGS = {"text": "x" * 100}  # 100 bytes of arguments, as the typical call
TOOL = {
    "name": "noop",
    "executor": "python",
    "function": "workers.executors.builtin:noop",
    "timeout": 10,
    "concurrency": 1000,
    "queue_size": 1_000_000,
}
CHUNK = 1000  # calls submitted (and awaited) at a time


def _audit_bytes(conn: Any) -> int:
    from broker import audit

    return sum(int(conn.memory_usage(k, samples=0) or 0) for k in (audit.AUDIT_STREAM, audit.AUDIT_INDEX))


def _used(conn: Any) -> int:
    return int(conn.info("memory")["used_memory"])


def _run(gw: Any, n: int) -> list[str]:
    """Run ``n`` calls to their end, CHUNK at a time; returns their ids."""
    ids: list[str] = []
    for start in range(0, n, CHUNK):
        batch = gw.map("noop", [ARGS] * min(CHUNK, n - start))
        for h in batch:
            h.result(timeout=120)
            ids.append(h.call_id)
    return ids


def _record_bytes(conn: Any, call_id: str) -> int:
    from broker import keys

    own = (keys.job(call_id), keys.history(call_id), keys.ended(call_id))  # (an ended call has no history list)
    return sum(int(conn.memory_usage(k, samples=0) or 0) for k in own)


class _Stack:
    """A scratch HERMES_HOME with the no-op tool, worker processes and a client on ``url``."""

    def __init__(self, url: str, processes: int, concurrency: int, result_ttl: int) -> None:
        from hermes_gateway.client import Gateway

        self.home = scratch_home([TOOL])
        self.procs = start_workers(
            url, self.home, "tools", processes, concurrency, {"HERMES_RESULT_TTL": str(result_ttl)}
        )
        self.gw = Gateway.connect(url, home=str(self.home), embedded_ok=False, check_workers=False)
        self.gw.sync_tools(self.home / "tools")
        wait_for_workers(self.gw.conn, processes, "tools")

    def close(self) -> None:
        self.gw.close()
        stop(self.procs)


def bytes_per_call(url: str, n: int = 5000, processes: int = 1, concurrency: int = 64) -> dict[str, Any]:
    """Redis bytes per finished call on ``url`` (see the module docstring)."""
    stack = _Stack(url, processes, concurrency, result_ttl=3600)
    try:
        conn = stack.gw.conn
        _run(stack.gw, 500)  # warm-up: scripts, queues, client buffers, the audit stream's first nodes
        time.sleep(0.5)
        used0, audit0 = _used(conn), _audit_bytes(conn)
        ids = _run(stack.gw, n)
        time.sleep(0.5)  # (the last writes of the workers' outboxes)
        used1, audit1 = _used(conn), _audit_bytes(conn)
        sample = [_record_bytes(conn, cid) for cid in ids[-50:]]
    finally:
        stack.close()
    return {
        "calls": n,
        "used_memory_delta": used1 - used0,
        "audit_delta": audit1 - audit0,
        "bytes_per_call": round((used1 - used0 - (audit1 - audit0)) / n, 1),
        "audit_bytes_per_call": round((audit1 - audit0) / n, 1),
        "record_bytes": int(statistics.median(sample)),
        "record_bytes_max": max(sample),
        "goal": 800,
    }


def soak(url: str, seconds: float, processes: int = 1, concurrency: int = 64, every: float = 10.0) -> dict[str, Any]:
    """Calls at full speed for ``seconds`` with ``workers.result_ttl: 60``; used_memory along the way."""
    stack = _Stack(url, processes, concurrency, result_ttl=60)
    samples: list[dict[str, float]] = []
    done = 0
    try:
        conn = stack.gw.conn
        _run(stack.gw, 500)
        start = time.monotonic()
        next_sample = start
        while time.monotonic() - start < seconds:
            if time.monotonic() >= next_sample:
                samples.append(
                    {"t": round(time.monotonic() - start, 1), "used_memory": _used(conn), "audit": _audit_bytes(conn)}
                )
                next_sample += every
            done += len(_run(stack.gw, CHUNK))
        elapsed = time.monotonic() - start
        samples.append({"t": round(elapsed, 1), "used_memory": _used(conn), "audit": _audit_bytes(conn)})
    finally:
        stack.close()
    first, last = samples[0], samples[-1]
    after_ttl = [s for s in samples if s["t"] >= 70] or samples  # once the first records have expired
    return {
        "seconds": round(elapsed, 1),
        "calls": done,
        "calls_per_s": round(done / elapsed, 1),
        "result_ttl": 60,
        "used_memory_start": first["used_memory"],
        "used_memory_end": last["used_memory"],
        "used_memory_max": max(s["used_memory"] for s in samples),
        "without_audit_start": first["used_memory"] - first["audit"],
        "without_audit_end": last["used_memory"] - last["audit"],
        "without_audit_after_ttl_min": min(s["used_memory"] - s["audit"] for s in after_ttl),
        "without_audit_after_ttl_max": max(s["used_memory"] - s["audit"] for s in after_ttl),
        "samples": samples,
    }


def peer_bytes_per_job(kind: str, url: str, n: int) -> dict[str, Any]:
    """Redis bytes a finished job of ``kind`` (``dramatiq``, ``rq``) keeps: ``used_memory`` growth over ``n``
    finished jobs with the same 100-byte arguments, after a warm-up (their keys are deleted after)."""
    import uuid

    from redis import Redis
    from rq import Queue

    tag = uuid.uuid4().hex[:8]
    conn = Redis.from_url(url, socket_timeout=None)
    if kind == "dramatiq":
        queue = f"dqmem-{tag}"
        actors = dramatiq_results(url, queue, f"{queue}-first")
        procs = start_dramatiq(url, queue, f"{queue}-first", 8)
        pending = f"dramatiq:{queue}.msgs"

        def run(count: int) -> None:
            for _ in range(count):
                actors.noop_text.send(ARGS["text"])
            deadline = time.monotonic() + 600
            while conn.hlen(pending) and time.monotonic() < deadline:
                time.sleep(0.05)
    else:
        queue = f"rqmem-{tag}"
        procs = start_rq_workers(url, queue, 1)
        q = Queue(queue, connection=conn)

        def run(count: int) -> None:
            base = q.finished_job_registry.count
            for start in range(0, count, CHUNK):
                q.enqueue_many([Queue.prepare_data("bench.rqjobs.noop_text", (ARGS["text"],)) for _ in range(min(CHUNK, count - start))])
            deadline = time.monotonic() + 600
            while q.finished_job_registry.count < base + count and time.monotonic() < deadline:
                time.sleep(0.05)

    try:
        if kind == "rq":
            wait_for_workers(conn, 1, queue, timeout=60)
        run(200)  # warm-up
        time.sleep(0.5)
        used0 = _used(conn)
        run(n)
        time.sleep(0.5)
        used1 = _used(conn)
    finally:
        (stop_rq if kind == "rq" else stop)(procs)
        for key in conn.scan_iter(f"*{tag}*"):
            conn.delete(key)
        conn.close()
    return {"jobs": n, "used_memory_delta": used1 - used0, "bytes_per_job": round((used1 - used0) / n, 1)}


def _provenance() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }


def write(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps({**_provenance(), **result}, indent=2) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--calls", type=int, default=5000)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--soak", type=float, default=0.0, help="seconds of calls at full speed (result_ttl 60)")
    parser.add_argument("--url", default=None, help="Redis URL (default $HERMES_REDIS_URL, else embedded)")
    parser.add_argument("--no-peers", action="store_true", help="ours only (no Dramatiq, no RQ)")
    args = parser.parse_args()
    with using_broker(args.url) as url:
        from broker.connection import from_url

        conn = from_url(url)
        version = conn.info("server").get("redis_version")
        conn.close()
        if args.soak > 0:
            out = soak(url, args.soak, args.processes, args.concurrency)
            print(f"soak {out['seconds']:.0f} s at {out['calls_per_s']:,.0f} calls/s ({out['calls']:,} calls), result_ttl 60")
            print(f"used_memory start={out['used_memory_start']:,} end={out['used_memory_end']:,} max={out['used_memory_max']:,}")
            print(f"without the audit stream: start={out['without_audit_start']:,} end={out['without_audit_end']:,}; after the first "
                  f"ttl {out['without_audit_after_ttl_min']:,}..{out['without_audit_after_ttl_max']:,}")
            path = write("memory-soak.json", {"redis": version, **out})
        else:
            out = bytes_per_call(url, args.calls, args.processes, args.concurrency)
            print(f"{out['calls']:,} finished calls (100-byte args, no result) on Redis {version}")
            print(f"record_bytes={out['record_bytes']} (MEMORY USAGE of one ended call's job hash + history; max {out['record_bytes_max']})")
            print(f"audit_bytes_per_call={out['audit_bytes_per_call']} (the capped audit stream, counted apart)")
            if not args.no_peers:
                out["peers"] = {kind: peer_bytes_per_job(kind, url, args.calls) for kind in ("dramatiq", "rq")}
                dq, rq = out["peers"]["dramatiq"], out["peers"]["rq"]
                print(f"Dramatiq (Results on Redis): {dq['bytes_per_job']} bytes a finished job; stock RQ: {rq['bytes_per_job']}")
                print(f"ours with the audit stream's growth (the peers keep no audit log): "
                      f"{out['bytes_per_call'] + out['audit_bytes_per_call']:.1f}")
            path = write("memory.json", {"redis": version, **out})
            print(f"written to {shown(path)}")
            print(f"bytes_per_call={out['bytes_per_call']}  (used_memory delta / N less the audit's growth; goal <= 800)")
            return
        print(f"written to {shown(path)}")


if __name__ == "__main__":
    main()
