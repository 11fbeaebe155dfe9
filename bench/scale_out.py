"""Past one Redis: what a call costs Redis, how it spreads over shards, and a Sentinel failover.

Every Redis here is a local redis-server process this script starts on free loopback ports (and stops):
- plain Redis: Redis CPU per no-op call (µs, ``INFO cpu`` used_cpu_sys + used_cpu_user before and after a
  batch, the batch's worker processes warm), and stock RQ's per no-op job on its own plain Redis, side by
  side; calls/s with 1 and 2 worker processes;
- Sentinel (a primary, its replica, three Sentinels; ``broker.wait_replicas: 1``): Redis CPU per call
  summed over all five processes; then the primary is killed (-9) mid-batch: seconds from the kill to the
  first call done on the promoted replica, and accepted calls lost, stuck, and run twice;
- a 3-primary Redis Cluster (``redis+cluster://``): Redis CPU per call summed over the nodes, calls/s with
  1 and 2 worker processes, and with one queue split in 6 partitions (``queue_partitions: 6``) the busiest
  shard's share of the Redis CPU (ideal 0.333); 6 separate queues are shown too.
Fleet (``--fleet``, also run by default): calls/s with 1, 2 and 4 worker processes of 8 slots each on plain
Redis (and on the cluster unless skipped), rounds interleaved (medians), with where the time goes: CPU
seconds per 1,000 calls of Redis, of this process (the caller) and of the worker processes, and what
the machine's cores would allow at that cost (``nproc / CPU seconds per call``). Written as JSON to
``bench/results/scale_out-<date>-<commit>.json``.
The last line is ``busiest_shard_share=<x>`` (``scale_1_to_2=<x>`` with ``--fleet-only``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS,
    ROOT,
    scratch_home,
    shown,
    start_rq_workers,
    start_workers,
    stop,
    stop_rq,
    wait_for_workers,
)
from tests.redis_stack import ClusterStack, SentinelStack, Server, data_node  # noqa: E402

NOOP = "workers.executors.builtin:noop"
MARK = "bench.failover_tools:mark"
SLOTS = 8  # concurrency of each worker process


def cpu_seconds(servers: list[Server]) -> list[float]:
    """used_cpu_sys + used_cpu_user of each server, now."""
    out = []
    for s in servers:
        info = s.client().info("cpu")
        out.append(float(info["used_cpu_sys"]) + float(info["used_cpu_user"]))
    return out


def _gateway(url: str, home: Path) -> Any:
    from broker.config import load_settings
    from broker.connection import BrokerHandle, from_url
    from hermes_gateway import Gateway

    return Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))


def _wait_live(gw: Any, queue: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(gw.live_workers(queue)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} worker(s) did not start on {queue}")
        time.sleep(0.05)


def run_ours(
    url: str,
    servers: list[Server],
    n: int,
    processes: int,
    queues: int = 1,
    config: dict[str, Any] | None = None,
    partitions: int = 1,
) -> dict[str, Any]:
    """``n`` no-op calls spread over ``queues`` queues (one tool each, split in ``partitions``); Redis CPU
    per server and calls/s."""
    tag = uuid.uuid4().hex[:6]
    names = [f"q{i}-{tag}" for i in range(queues)]
    tools = [
        {"name": f"noop_{i}_{tag}", "executor": "python", "function": NOOP, "queue": q, "concurrency": 100_000,
         "queue_size": 1_000_000, "queue_partitions": partitions}
        for i, q in enumerate(names)
    ]
    home = scratch_home(tools, config)
    procs = start_workers(url, home, ",".join(names), processes, SLOTS)
    try:
        gw = _gateway(url, home)
        gw.sync_tools(home / "tools")
        for q in names:
            _wait_live(gw, q, processes)
        calls: list[tuple[str, dict[str, Any]]] = [(str(t["name"]), {}) for t in tools]
        for h in gw.submit_many(calls * 20):  # warm-up: every process imported, connected, scripts loaded
            h.result(60)
        before, procs_before = cpu_seconds(servers), process_cpu(procs)
        start = time.perf_counter()
        handles: list[Any] = []
        for i in range(0, n, 500):
            handles.extend(gw.submit_many([calls[j % len(calls)] for j in range(i, min(n, i + 500))]))
        for h in handles:
            h.result(120)
        elapsed = time.perf_counter() - start
        after, procs_after = cpu_seconds(servers), process_cpu(procs)
        gw.close()
    finally:
        stop(procs)
    used = [a - b for a, b in zip(after, before, strict=True)]
    workers, client = (b - a for a, b in zip(procs_before, procs_after, strict=True))
    return {
        "us_per_call": sum(used) / n * 1e6,
        "per_server": used,
        "calls_per_s": n / elapsed,
        # CPU seconds per 1,000 calls: where the time goes
        "redis_s_per_1k": sum(used) / n * 1000,
        "workers_s_per_1k": workers / n * 1000,
        "client_s_per_1k": client / n * 1000,
    }


def process_cpu(procs: list[subprocess.Popen[bytes]]) -> tuple[float, float]:
    """(CPU seconds so far of the worker processes and their children, of this process)."""
    import psutil

    workers = 0.0
    for p in procs:
        try:
            parent = psutil.Process(p.pid)
            for q in (parent, *parent.children(recursive=True)):
                workers += sum(q.cpu_times()[:2])
        except psutil.Error:
            pass
    return workers, sum(psutil.Process().cpu_times()[:2])


def fleet(url: str, servers: list[Server], n: int, rounds: int, counts: tuple[int, ...] = (1, 2, 4)) -> dict[str, Any]:
    """calls/s and CPU seconds per 1,000 calls with each number of worker processes (8 slots each), rounds
    interleaved (each starting at another count); medians per count."""
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in counts}
    for r in range(rounds):
        for c in counts[r % len(counts):] + counts[: r % len(counts)]:
            runs[c].append(run_ours(url, servers, n, c))
    fields = ("calls_per_s", "redis_s_per_1k", "workers_s_per_1k", "client_s_per_1k")
    out: dict[str, Any] = {}
    for c in counts:
        med = {f: statistics.median(x[f] for x in runs[c]) for f in fields}
        total = med["redis_s_per_1k"] + med["workers_s_per_1k"] + med["client_s_per_1k"]
        med["total_cpu_s_per_1k"] = total
        med["cores_allow_calls_per_s"] = (os.cpu_count() or 1) / total * 1000  # if CPU were the only bound
        med["cores_busy"] = med["calls_per_s"] * total / 1000
        out[str(c)] = {"median": med, "runs": runs[c]}
    base = out[str(counts[0])]["median"]["calls_per_s"]
    for c in counts:
        out[str(c)]["median"]["speedup"] = out[str(c)]["median"]["calls_per_s"] / base
    return out


def print_fleet(name: str, result: dict[str, Any]) -> None:
    print(f"{name}: processes  calls/s  speedup   CPU s per 1,000 calls: Redis  workers  caller  total"
          "   cores busy  calls/s the cores allow")
    for c, v in result.items():
        m = v["median"]
        print(f"  {c:>21}  {m['calls_per_s']:7,.0f}  {m['speedup']:6.2f}x  {m['redis_s_per_1k']:24.3f}"
              f"  {m['workers_s_per_1k']:7.3f}  {m['client_s_per_1k']:6.3f}  {m['total_cpu_s_per_1k']:5.3f}"
              f"   {m['cores_busy']:10.2f}  {m['cores_allow_calls_per_s']:,.0f}")


def write_result(result: dict[str, Any]) -> Path:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    sha = commit.stdout.strip()
    load = os.getloadavg()
    result = {"bench": "scale_out", "commit": sha, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "nproc": os.cpu_count(), "loadavg_end": round(load[0], 2), "python": platform.python_version(),
              "slots_per_process": SLOTS, **result}
    out = RESULTS / f"scale_out-{time.strftime('%Y%m%d-%H%M%S')}-{sha[:7]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {shown(out)}")
    return out


def run_rq(server: Server, n: int) -> float:
    """Redis CPU (µs) per no-op job through stock RQ (one SimpleWorker process)."""
    from redis import Redis
    from rq import Queue

    url = f"redis://127.0.0.1:{server.port}/0"
    conn = Redis(port=server.port)
    name = f"rqscale-{uuid.uuid4().hex[:6]}"
    q = Queue(name, connection=conn)
    procs = start_rq_workers(url, name, 1)
    try:
        wait_for_workers(conn, 1, name)
        q.enqueue_many([Queue.prepare_data("bench.rqjobs.noop") for _ in range(20)])
        _finished(q, 20)
        before = cpu_seconds([server])[0]
        for i in range(0, n, 500):
            q.enqueue_many([Queue.prepare_data("bench.rqjobs.noop") for _ in range(min(500, n - i))])
        _finished(q, 20 + n)
        used = cpu_seconds([server])[0] - before
    finally:
        stop_rq(procs)
    return used / n * 1e6


def _finished(q: Any, count: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while q.finished_job_registry.count < count:
        if time.monotonic() > deadline:
            raise RuntimeError("stock RQ did not finish in time")
        time.sleep(0.01)


def run_failover(stack: SentinelStack, n: int, lease: float) -> dict[str, Any]:
    """Kill -9 the primary while ``n`` short calls run on two workers (wait_replicas 1)."""
    marks = Path(stack.dir) / "marks"
    marks.mkdir()
    tool = {
        "name": "mark",
        "executor": "python",
        "function": MARK,
        "concurrency": 100_000,
        "queue_size": 1_000_000,
        "timeout": 60,
    }
    home = scratch_home([tool], {"broker": {"wait_replicas": 1, "wait_timeout_ms": 1000}})
    url = stack.url(0)
    procs = start_workers(url, home, "tools", 2, SLOTS, {"HERMES_LEASE": str(lease)})
    try:
        gw = _gateway(url, home)
        gw.sync_tools(home / "tools")
        _wait_live(gw, "tools", 2)
        batch = gw.map("mark", [{"id": f"c{i}", "dir": str(marks), "seconds": 0.05} for i in range(n)])
        accepted = batch.accepted
        while sum(h.done() for h in accepted) < len(accepted) // 5:
            time.sleep(0.01)
        old = stack.master_port()
        stack.node(old).kill()
        killed = time.monotonic()
        time.sleep(0.1)  # events already on their way from the old primary are in by now
        done_at_kill = sum(h.done() for h in accepted)
        first: list[float] = []

        def watch() -> None:
            while time.monotonic() < killed + 120:
                if sum(h.done() for h in accepted) > done_at_kill:
                    first.append(time.monotonic() - killed)
                    return
                time.sleep(0.01)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        stack.wait_failover(old)
        promoted = time.monotonic() - killed
        lost = 0
        for h in accepted:
            try:
                h.result(120)
            except Exception:  # noqa: BLE001 - counted
                lost += 1
        watcher.join(5)
        records = {h.call_id: gw.calls.record(h.call_id) for h in accepted}
        stuck = sum(1 for r in records.values() if r is None or r["state"] not in ("done", "failed", "cancelled"))
        runs: dict[str, int] = {}
        for p in marks.iterdir():
            key = p.name.split(".")[0]
            runs[key] = runs.get(key, 0) + 1
        twice = [i for i in range(n) if runs.get(f"c{i}", 0) > 1]
        reported = sum(1 for i in twice if (records.get(accepted[i].call_id) or {}).get("attempt", 1) > 1)
        gw.close()
    finally:
        stop(procs)
    return {
        "accepted": len(accepted),
        "promoted_s": promoted,
        "first_done_s": first[0] if first else float("nan"),
        "lost": lost,
        "stuck": stuck,
        "duplicated": len(twice),
        "duplicated_reported": reported,
        "never_ran": sum(1 for i in range(n) if f"c{i}" not in runs),
    }


def cluster_supported() -> str | None:
    """None when ``redis+cluster://`` URLs connect; else why not."""
    from broker.connection import from_url
    from broker.errors import HermesError
    from tests.redis_stack import free_port

    try:
        from_url(f"redis+cluster://127.0.0.1:{free_port()}").close()
    except HermesError as e:
        if "must specify one of the following schemes" in str(e):
            return "redis+cluster:// is not known to broker.connection in this build"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--calls", type=int, default=2000, help="no-op calls per measurement")
    parser.add_argument("--failover-calls", type=int, default=400)
    parser.add_argument("--lease", type=float, default=5.0, help="worker lease in the failover run (seconds)")
    parser.add_argument("--skip-rq", action="store_true")
    parser.add_argument("--skip-failover", action="store_true")
    parser.add_argument("--skip-cluster", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the fleet figures")
    parser.add_argument("--fleet-only", action="store_true", help="only the fleet figures (1, 2, 4 processes)")
    parser.add_argument("--fleet", default="1,2,4", help="worker process counts of the fleet figures")
    parser.add_argument(
        "--reuse-fleet", action="store_true",
        help="a quick run (the tests'): the 1- and 2-process figures of plain Redis and of the cluster are the "
        "fleet's first round, not measured again (--fleet must name 1 and 2)",
    )
    args = parser.parse_args()
    n = args.calls
    counts = tuple(int(c) for c in args.fleet.split(","))
    if args.reuse_fleet and not {1, 2} <= set(counts):
        parser.error("--reuse-fleet needs --fleet to name 1 and 2")
    print(f"{n} warm no-op calls per figure; {SLOTS} slots per worker process; every Redis a local process; "
          f"nproc {os.cpu_count()}; load {os.getloadavg()[0]:.2f}")
    result: dict[str, Any] = {"calls": n, "rounds": args.rounds}
    plain = data_node(Path(__import__("tempfile").mkdtemp(prefix="hermes-plain-")), "plain").start()
    try:
        result["fleet_plain"] = fleet(f"redis://127.0.0.1:{plain.port}/0", [plain], n, args.rounds, counts)
        print_fleet("plain Redis", result["fleet_plain"])
    finally:
        plain.stop()
    if not args.skip_cluster and cluster_supported() is None:
        with ClusterStack(3) as cluster:
            result["fleet_cluster"] = fleet(cluster.url(), cluster.nodes, n, args.rounds, counts)
            print_fleet("cluster, 3 primaries", result["fleet_cluster"])
    write_result(result)
    if args.fleet_only:
        print(f"scale_1_to_2={result['fleet_plain']['2']['median']['speedup']:.2f}")
        return

    plain = data_node(Path(__import__("tempfile").mkdtemp(prefix="hermes-plain-")), "plain").start()
    try:
        url = f"redis://127.0.0.1:{plain.port}/0"
        if args.reuse_fleet:
            one, two = (result["fleet_plain"][c]["runs"][0] for c in ("1", "2"))
        else:
            one = run_ours(url, [plain], n, 1)
            two = run_ours(url, [plain], n, 2)
        print(f"plain Redis: {one['us_per_call']:.1f} µs Redis CPU per call (1 worker process); "
              f"{one['calls_per_s']:,.0f} calls/s with 1 worker process, {two['calls_per_s']:,.0f} with 2")
        if not args.skip_rq:
            rq = run_rq(plain, n)
            print(f"stock RQ, plain Redis: {rq:.1f} µs Redis CPU per job (1 SimpleWorker); "
                  f"ours/RQ = {one['us_per_call'] / rq:.2f}")
    finally:
        plain.stop()

    with SentinelStack() as stack:
        servers = [stack.primary, stack.replica, *stack.sentinels]
        sent = run_ours(stack.url(0), servers, n, 1, config={"broker": {"wait_replicas": 1}})
        parts = ", ".join(f"{s.name} {u / n * 1e6:.1f}" for s, u in zip(servers, sent["per_server"], strict=True))
        print(f"Sentinel (wait_replicas 1): {sent['us_per_call']:.1f} µs Redis CPU per call, summed ({parts}); "
              f"{sent['calls_per_s']:,.0f} calls/s with 1 worker process")
        if not args.skip_failover:
            f = run_failover(stack, args.failover_calls, args.lease)
            print(f"failover (kill -9 of the primary, {f['accepted']} calls accepted, lease {args.lease:g}s): "
                  f"promoted after {f['promoted_s']:.1f}s; first call done on the new primary {f['first_done_s']:.1f}s "
                  f"after the kill; lost={f['lost']} stuck={f['stuck']} duplicated={f['duplicated']} "
                  f"(reported as attempt > 1: {f['duplicated_reported']}); never ran={f['never_ran']}")

    why = "skipped (--skip-cluster)" if args.skip_cluster else cluster_supported()
    if why is not None:
        print(f"cluster: {why}")
        print("busiest_shard_share=n/a")
        return
    with ClusterStack(3) as cluster:
        if args.reuse_fleet and "fleet_cluster" in result:
            c1, c2 = (result["fleet_cluster"][c]["runs"][0] for c in ("1", "2"))
        else:
            c1 = run_ours(cluster.url(), cluster.nodes, n, 1)
            c2 = run_ours(cluster.url(), cluster.nodes, n, 2)
        print(f"cluster, 3 primaries, 1 queue: {c1['us_per_call']:.1f} µs Redis CPU per call summed over the nodes "
              f"({c1['us_per_call'] / one['us_per_call']:.2f}x plain); {c1['calls_per_s']:,.0f} calls/s with 1 worker "
              f"process, {c2['calls_per_s']:,.0f} with 2")
        six = run_ours(cluster.url(), cluster.nodes, n, 2, queues=6)
        shares = [u / sum(six["per_server"]) for u in six["per_server"]]
        print(f"cluster, 3 primaries, 6 queues, 2 worker processes: {six['us_per_call']:.1f} µs per call; "
              f"{six['calls_per_s']:,.0f} calls/s; shares of Redis CPU per node: {', '.join(f'{s:.3f}' for s in shares)} "
              "(where 6 queue names happen to hash)")
        split = run_ours(cluster.url(), cluster.nodes, n, 2, partitions=6)
        spread = [u / sum(split["per_server"]) for u in split["per_server"]]
        print(f"cluster, 3 primaries, 1 queue with queue_partitions: 6, 2 worker processes: {split['us_per_call']:.1f} "
              f"µs per call; {split['calls_per_s']:,.0f} calls/s; shares of Redis CPU per node: "
              f"{', '.join(f'{s:.3f}' for s in spread)}")
        print(f"busiest_shard_share={max(spread):.3f}")


if __name__ == "__main__":
    main()
