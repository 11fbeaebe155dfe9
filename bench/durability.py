"""What a single Redis promises, and what each stronger setting costs.

Every Redis here is a local redis-server process this script starts on a free loopback port, its files in
a temporary directory on this machine's disk (it stops them and removes the directory at the end):
- ``off``: appendonly no (nothing on disk: a restart loses everything);
- ``everysec``: ``appendonly yes``, ``appendfsync everysec`` (Redis' default when AOF is on);
- ``always``: ``appendonly yes``, ``appendfsync always`` (an fsync before each reply);
- ``replica``: a primary (``everysec``) and one replica, the gateway with ``broker.wait_replicas: 1``
  (every submission, claim and batch of worker writes waits for ``WAIT 1``).

For each, in the same run (rounds interleaved; medians): p50 and p99 of one submission (``call_tool``
returning its handle, one call at a time, each run to its end before the next) and calls/s of a warm
batch of no-op calls end to end (``submit_many`` in pipelines of 500, one worker process with 8 slots).

Then (``--kill-calls``, 0 to skip) the crash experiment, ``--kill-trials`` times for ``everysec`` and for
``always``: a batch of calls of a tool that leaves one file per run (``bench/failover_tools.py``), Redis
killed with SIGKILL ``--kill-after`` seconds after the batch was accepted and started again on its AOF,
every handle waited for: calls lost (accepted, never ended), stuck, run twice (counted from the files),
and of those how many report ``attempt`` > 1; and, just before the kill, ``aof_buffer_length`` (bytes Redis
holds back while an fsync lags: what a kill of the process alone loses) and the fsyncs pending;
``--busy-disk MB`` keeps the disk busy meanwhile (a thread rewriting and fsyncing a file of that size).

Results go to ``bench/results/durability-<time>.json``. The last line is ``always_vs_everysec=<x>``: calls/s
with ``appendfsync always`` over calls/s with ``everysec`` (``nan`` with ``--rounds 0``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, ROOT, scratch_home, start_workers, stop  # noqa: E402
from tests.redis_stack import Server, _wait, data_node  # noqa: E402

NOOP = "workers.executors.builtin:noop"
MARK = "bench.failover_tools:mark"
SLOTS = 8
AOF = {
    "off": [],
    "everysec": ["--appendonly", "yes", "--appendfsync", "everysec"],
    "always": ["--appendonly", "yes", "--appendfsync", "always"],
}
MODES = ("off", "everysec", "always", "replica")


def _gateway(url: str, home: Path) -> Any:
    from broker.config import load_settings
    from broker.connection import BrokerHandle, from_url
    from hermes_gateway import Gateway

    return Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))


def _wait_live(gw: Any, queue: str, count: int, timeout: float = 60.0) -> None:
    _wait(lambda: len(gw.live_workers(queue)) >= count, timeout, f"{count} worker(s) on {queue}")


@contextmanager
def redis_for(mode: str, workdir: Path) -> Iterator[tuple[str, list[Server]]]:
    """The URL of a fresh Redis set up as ``mode``, and its server processes."""
    if mode != "replica":
        node = data_node(workdir, f"{mode}-{uuid.uuid4().hex[:4]}", AOF[mode]).start()
        servers = [node]
    else:
        primary = data_node(workdir, f"primary-{uuid.uuid4().hex[:4]}", AOF["everysec"]).start()
        replica = data_node(workdir, f"replica-{uuid.uuid4().hex[:4]}",
                            [*AOF["everysec"], "--replicaof", "127.0.0.1", str(primary.port)]).start()  # fmt: skip
        _wait(
            lambda: replica.client().info("replication").get("master_link_status") == "up",
            30,
            "the replica's sync",
        )
        servers = [primary, replica]
    try:
        yield f"redis://127.0.0.1:{servers[0].port}/0", servers
    finally:
        for s in servers:
            s.stop()


def measure(mode: str, workdir: Path, n: int, singles: int) -> dict[str, Any]:
    """p50/p99 of one submission and calls/s of ``n`` no-op calls on a fresh Redis set up as ``mode``."""
    tool = {"name": "noop", "executor": "python", "function": NOOP, "concurrency": 100_000,
            "queue_size": 1_000_000}  # fmt: skip
    config = {"broker": {"wait_replicas": 1, "wait_timeout_ms": 1000}} if mode == "replica" else None
    home = scratch_home([tool], config)
    with redis_for(mode, workdir) as (url, _servers):
        procs = start_workers(url, home, "tools", 1, SLOTS, log_level="WARNING")
        try:
            gw = _gateway(url, home)
            gw.sync_tools(home / "tools")
            _wait_live(gw, "tools", 1)
            for h in gw.submit_many([("noop", {})] * 200):  # warm: imported, connected, scripts loaded
                h.result(60)
            submit: list[float] = []
            for _ in range(singles):
                t0 = time.perf_counter()
                h = gw.call_tool("noop", {})
                submit.append(time.perf_counter() - t0)
                h.result(60)
            start = time.perf_counter()
            handles: list[Any] = []
            for i in range(0, n, 500):
                handles.extend(gw.submit_many([("noop", {})] * min(500, n - i)))
            for h in handles:
                h.result(120)
            elapsed = time.perf_counter() - start
            gw.close()
        finally:
            stop(procs)
    q = statistics.quantiles(submit, n=100)
    return {"calls_per_s": n / elapsed, "submit_p50_ms": q[49] * 1e3, "submit_p99_ms": q[98] * 1e3}


@contextmanager
def busy_disk(workdir: Path, mb: int) -> Iterator[None]:
    """While the block runs (``mb`` > 0), a thread rewrites an ``mb`` MB file in ``workdir`` and fsyncs it,
    over and over: a disk other work keeps busy, as a shared machine's is."""
    if mb <= 0:
        yield
        return
    done = threading.Event()
    chunk = os.urandom(1 << 20)

    def churn() -> None:
        with (workdir / "busy-disk").open("wb") as f:
            while not done.is_set():
                f.seek(0)
                for _ in range(mb):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        (workdir / "busy-disk").unlink(missing_ok=True)


def crash(
    mode: str, workdir: Path, n: int, after: float, seconds: float, lease: float, disk_mb: int = 0
) -> dict[str, Any]:
    """Kill -9 Redis (``mode``, AOF on) ``after`` seconds after a batch of ``n`` calls was accepted, start it
    again on its AOF, and count what happened to each call (with ``disk_mb``, on a busy disk)."""
    marks = Path(tempfile.mkdtemp(prefix="marks-", dir=workdir))
    tool = {"name": "mark", "executor": "python", "function": MARK, "concurrency": 100_000,
            "queue_size": 1_000_000, "timeout": 60}  # fmt: skip
    home = scratch_home([tool])
    node = data_node(workdir, f"crash-{mode}-{uuid.uuid4().hex[:4]}", AOF[mode]).start()
    url = f"redis://127.0.0.1:{node.port}/0"
    procs = start_workers(url, home, "tools", 2, SLOTS, {"HERMES_LEASE": str(lease)}, log_level="ERROR")
    try:
        gw = _gateway(url, home)
        gw.sync_tools(home / "tools")
        _wait_live(gw, "tools", 2)
        with busy_disk(workdir, disk_mb):
            batch = gw.map("mark", [{"id": f"c{i}", "dir": str(marks), "seconds": seconds} for i in range(n)])
            accepted = batch.accepted
            time.sleep(after)  # the experiment's own delay, not a synchronisation
            ran_at_kill = len(list(marks.iterdir()))
            # Bytes Redis holds back in its AOF buffer (not yet written to the file: what a kill -9 of the
            # process alone loses; it holds them while an everysec fsync lags), and fsyncs still pending.
            info = node.client().info("persistence")
            held = (int(info.get("aof_buffer_length", 0)), int(info.get("aof_pending_bio_fsync", 0)))
            node.kill()
            killed = time.monotonic()
        node.start()  # same port, same directory: it loads its AOF
        restart = time.monotonic() - killed
        lost = 0
        for h in accepted:
            try:
                h.result(180)
            except Exception:  # noqa: BLE001 - counted: any outcome but a result is a lost call here
                lost += 1
        records = {h.call_id: gw.calls.record(h.call_id) for h in accepted}
        stuck = sum(
            1 for r in records.values() if r is None or r["state"] not in ("done", "failed", "cancelled")
        )
        runs: dict[str, int] = {}
        for p in marks.iterdir():
            key = p.name.split(".")[0]
            runs[key] = runs.get(key, 0) + 1
        twice = [i for i in range(n) if runs.get(f"c{i}", 0) > 1]
        reported = sum(
            1 for i in twice if int((records.get(accepted[i].call_id) or {}).get("attempt", 1)) > 1
        )
        gw.close()
    finally:
        stop(procs)
        node.stop()
    return {
        "mode": mode,
        "accepted": len(accepted),
        "kill_after_s": after,
        "busy_disk_mb": disk_mb,
        "runs_started_at_kill": ran_at_kill,
        "restart_s": restart,
        "aof_buffer_length_at_kill": held[0],
        "aof_pending_bio_fsync_at_kill": held[1],
        "lost": lost,
        "stuck": stuck,
        "ran_twice": len(twice),
        "ran_twice_reported_attempt_gt_1": reported,
        "never_ran": sum(1 for i in range(n) if f"c{i}" not in runs),
        "most_runs": max(runs.values(), default=0),
    }


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--calls", type=int, default=3000, help="no-op calls per calls/s figure")
    parser.add_argument("--singles", type=int, default=500, help="one-at-a-time submissions per p50/p99")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, modes interleaved; medians (0: none)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument(
        "--kill-calls", type=int, default=500, help="calls in the kill -9 experiment (0: skip)"
    )
    parser.add_argument("--kill-after", type=float, default=0.2, help="seconds from accepted to SIGKILL")
    parser.add_argument("--kill-trials", type=int, default=3, help="kill -9 runs per AOF setting")
    parser.add_argument("--kill-tool-seconds", type=float, default=0.05, help="each call's run time there")
    parser.add_argument("--lease", type=float, default=5.0, help="worker lease in the kill -9 experiment")
    parser.add_argument("--busy-disk", type=int, default=0, metavar="MB",
                        help="rewrite and fsync an MB-sized file in a loop during each kill -9 run")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default bench/results/...)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown or "everysec" not in modes or "always" not in modes:
        parser.error(f"--modes: of {', '.join(MODES)}, with everysec and always (got {args.modes})")

    workdir = Path(tempfile.mkdtemp(prefix="hermes-durability-"))
    try:
        run(args, modes, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the Redis files (AOF) of every server it started


def run(args: argparse.Namespace, modes: list[str], workdir: Path) -> None:
    print(f"{args.calls} no-op calls per calls/s figure, {args.singles} single submissions per p50/p99, "
          f"{args.rounds} round(s); 1 worker process x {SLOTS} slots; Redis files in {workdir} "
          "(removed at the end)")  # fmt: skip
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            res = measure(mode, workdir, args.calls, args.singles)
            rounds[mode].append(res)
            print(f"round {r + 1} {mode}: {res['calls_per_s']:,.0f} calls/s; submit p50 "
                  f"{res['submit_p50_ms']:.2f} ms, p99 {res['submit_p99_ms']:.2f} ms")  # fmt: skip
    summary = (
        {}
        if not args.rounds
        else {
            m: {
                k: statistics.median(x[k] for x in rounds[m])
                for k in ("calls_per_s", "submit_p50_ms", "submit_p99_ms")
            }
            for m in modes
        }
    )
    for m in summary:
        s = summary[m]
        print(f"{m}: {s['calls_per_s']:,.0f} calls/s; submit p50 {s['submit_p50_ms']:.2f} ms, "
              f"p99 {s['submit_p99_ms']:.2f} ms (median of {args.rounds})")  # fmt: skip

    crashes = []
    if args.kill_calls > 0:
        for mode, trial in [(m, t) for t in range(args.kill_trials) for m in ("everysec", "always")]:
            c = crash(
                mode,
                workdir,
                args.kill_calls,
                args.kill_after,
                args.kill_tool_seconds,
                args.lease,
                args.busy_disk,
            )
            crashes.append(c)
            print(f"kill -9 #{trial + 1} ({mode}, {c['accepted']} calls accepted, Redis killed {args.kill_after:g}s "
                  f"later with {c['runs_started_at_kill']} runs started, aof_buffer_length="
                  f"{c['aof_buffer_length_at_kill']}, pending fsyncs={c['aof_pending_bio_fsync_at_kill']}): "
                  f"lost={c['lost']} stuck={c['stuck']} ran_twice={c['ran_twice']} (reported as attempt > 1: "
                  f"{c['ran_twice_reported_attempt_gt_1']}) never_ran={c['never_ran']}")  # fmt: skip
        for mode in ("everysec", "always"):
            mine = [c for c in crashes if c["mode"] == mode]
            total = {
                k: sum(c[k] for c in mine) for k in ("accepted", "lost", "stuck", "ran_twice", "never_ran")
            }
            print(f"kill -9 ({mode}), {len(mine)} run(s): {total['accepted']} calls accepted, lost={total['lost']} "
                  f"stuck={total['stuck']} ran_twice={total['ran_twice']} never_ran={total['never_ran']}")  # fmt: skip

    ratio = (
        summary["always"]["calls_per_s"] / summary["everysec"]["calls_per_s"] if args.rounds else float("nan")
    )
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"durability-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "bench": "durability",
        "date": stamp,
        "commit": _commit(),
        "nproc": os.cpu_count(),
        "load": os.getloadavg(),
        "python": platform.python_version(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rounds": rounds,
        "median": summary,
        "kill9": crashes,
        "always_vs_everysec": ratio,
    }
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"results: {out}")
    print(f"always_vs_everysec={ratio:.3f}")


if __name__ == "__main__":
    main()
