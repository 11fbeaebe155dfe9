"""End-to-end throughput of no-op tool calls: our stack against stock RQ on the same Redis.

Ours: enqueue → done event observed by the caller, with the full event path on.
RQ: the same number of no-op jobs (``bench.rqjobs.noop``) through ``SimpleWorker``, finished jobs counted
by the caller.
Both sides get the same number of warm worker processes. The last line is ``ratio_vs_rq=<x>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EXAMPLE_PLUGINS = Path(__file__).resolve().parent.parent / "examples" / "plugins"
SEED_PLUGINS = [
    "middleware-demo-llm-tag",
    "middleware-demo-terminal-workdir",
    "middleware-demo-llm-timing",
    "middleware-demo-tool-annotate",
]

from bench.common import scratch_home, start_rq_workers, start_workers, stop, using_broker, wait_for_workers  # noqa: E402


def run_ours(
    url: str,
    n: int,
    processes: int,
    concurrency: int,
    plugins: list[str] | None = None,
    tracing: bool = False,
    lean: bool = True,
    fast_path: bool = True,
    limit: int = 100_000,
) -> float:
    """Calls/s through our stack; ``tracing``: a real SDK pipeline (batch processor into memory) on both
    sides; ``fast_path`` False: redis-py's stock pipelines and pub/sub reads (``broker.fast_path``);
    ``limit``: the tool's concurrency (a low one makes calls wait for a slot: the admission path).
    Redis's CPU per timed call (``INFO cpu`` before and after, µs) is appended to ``REDIS_CPU``."""
    from broker.connection import from_url
    from hermes_gateway import Gateway
    from hermes_gateway.client import BrokerHandle

    queue = f"bench-{uuid.uuid4().hex[:8]}"
    tool = {
        "name": f"noop_{queue.replace('-', '_')}",
        "executor": "python",
        "function": "workers.executors.builtin:noop",
        "concurrency": limit,
        "queue_size": 1_000_000,
        "queue": queue,
    }
    config: dict[str, Any] = {"plugins": {"enabled": plugins}} if plugins else {}
    config["broker"] = {"fast_path": fast_path}  # (read by the workers and this client from config.yaml)
    home = scratch_home([tool], config)
    if plugins:
        import shutil

        for name in plugins:
            shutil.copytree(EXAMPLE_PLUGINS / name, home / "plugins" / name)
    conn = from_url(url)
    trace_env = {"HERMES_TRACE": "memory", "HERMES_LEAN_SPANS": "1" if lean else "0"} if tracing else None
    procs = start_workers(url, home, queue, processes, concurrency, trace_env)
    if tracing:
        _client_tracing(True)
    try:
        wait_for_workers(conn, processes, queue)
        from broker.config import load_settings

        gw = Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))
        gw.sync_tools(home / "tools")
        # Warm-up: a few calls so every process has imported and connected.
        name = str(tool["name"])
        for h in gw.map(name, [{}] * (20 * processes)):
            h.result(30)
        cpu = _redis_cpu(conn)
        start = time.perf_counter()
        handles: list[Any] = []
        batch = 500
        for i in range(0, n, batch):
            handles.extend(gw.map(name, [{}] * min(batch, n - i)))
        for h in handles:
            h.result(120)
        elapsed = time.perf_counter() - start
        REDIS_CPU.append((_redis_cpu(conn) - cpu) / n * 1e6)
        gw.close()
        return n / elapsed
    finally:
        if tracing:
            _client_tracing(False)
        stop(procs)


REDIS_CPU: list[float] = []  # µs of Redis CPU per call, one entry per run_ours


def _redis_cpu(conn: Any) -> float:
    """Seconds of CPU the Redis server has used (user + system, main thread and all)."""
    info = conn.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _client_tracing(on: bool) -> None:
    """The client's producer spans go through a batch processor into memory while ``on``."""
    from broker import otel

    if not on:
        otel.use_providers()
        return
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    otel.use_providers(tracer_provider=provider)


def run_rq(url: str, n: int, processes: int) -> float:
    from rq import Queue

    from broker.connection import from_url

    conn = from_url(url)
    queue_name = f"rqbench-{uuid.uuid4().hex[:8]}"
    q = Queue(queue_name, connection=conn)
    procs = start_rq_workers(url, queue_name, processes)
    try:
        wait_for_workers(conn, processes, queue_name)
        warm = [Queue.prepare_data("bench.rqjobs.noop") for _ in range(10 * processes)]
        jobs = q.enqueue_many(warm)
        _wait_finished(q, len(jobs))
        base = q.finished_job_registry.count
        start = time.perf_counter()
        batch = 500
        for i in range(0, n, batch):
            q.enqueue_many([Queue.prepare_data("bench.rqjobs.noop") for _ in range(min(batch, n - i))])
        _wait_finished(q, base + n)
        elapsed = time.perf_counter() - start
        return n / elapsed
    finally:
        stop(procs)


def _wait_finished(q: object, count: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while q.finished_job_registry.count < count:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise RuntimeError("stock RQ did not finish in time")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--calls", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument(
        "--limit", type=int, default=100_000, help="the tool's concurrency: 8 makes calls wait for slots (fair dispatch)"
    )
    parser.add_argument("--url", default=None, help="Redis URL (default $HERMES_REDIS_URL, else embedded)")
    parser.add_argument("--skip-plugins", action="store_true", help="skip the run with the example plugins")
    parser.add_argument("--skip-tracing", action="store_true", help="skip the run with tracing on")
    parser.add_argument(
        "--skip-stock", action="store_true", help="skip the run on redis-py's stock pipelines (broker.fast_path: false)"
    )
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"rq": [], "ours": [], "stock": [], "plugins": [], "tracing": [], "tracing_sdk": []}
    ours_cpu: list[float] = []
    with using_broker(args.url) as url:
        print(f"broker: {url}; {args.calls} no-op calls; {args.processes} worker process(es) each side; "
              f"{args.rounds} interleaved rounds (a shared 2-core machine is noisy: medians count)")
        for r in range(1, args.rounds + 1):
            # Interleaved, so slow and fast spells of the machine fall on every side alike.
            runs["rq"].append(run_rq(url, args.calls, args.processes))
            runs["ours"].append(run_ours(url, args.calls, args.processes, args.concurrency, limit=args.limit))
            ours_cpu.append(REDIS_CPU[-1])
            if not args.skip_stock:
                runs["stock"].append(run_ours(url, args.calls, args.processes, args.concurrency, fast_path=False))
            if not args.skip_plugins:
                runs["plugins"].append(run_ours(url, args.calls, args.processes, args.concurrency, SEED_PLUGINS))
            if not args.skip_tracing:
                runs["tracing"].append(run_ours(url, args.calls, args.processes, args.concurrency, tracing=True))
                runs["tracing_sdk"].append(
                    run_ours(url, args.calls, args.processes, args.concurrency, tracing=True, lean=False)
                )
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in runs.items() if v))
        rq_rate, ours = statistics.median(runs["rq"]), statistics.median(runs["ours"])
        print(f"stock RQ SimpleWorker: {rq_rate:,.0f} jobs/s (median)")
        print(f"hermes-gateway:        {ours:,.0f} calls/s (median; enqueue -> done event at the caller)")
        print(f"redis_cpu_per_call_us={statistics.median(ours_cpu):.1f}  (median; per round "
              + ", ".join(f"{c:.1f}" for c in ours_cpu) + f"; tool limit {args.limit})")
        if runs["stock"]:
            stock = statistics.median(runs["stock"])
            print(f"hermes-gateway on redis-py's stock pipelines and pub/sub: {stock:,.0f} calls/s (median)")
            print(f"stock_path_ratio={stock / ours:.3f}  (broker.fast_path pays when < 0.90)")
        if runs["plugins"]:
            with_plugins = statistics.median(runs["plugins"])
            print(f"hermes-gateway + the seed's 4 example plugins: {with_plugins:,.0f} calls/s (median)")
            print(f"plugins_ratio={with_plugins / ours:.3f}  (target >= 0.85)")
        if runs["tracing"]:
            traced = statistics.median(runs["tracing"])
            print(f"hermes-gateway + tracing (SDK, batch processor, in-memory): {traced:,.0f} calls/s (median)")
            print(f"tracing_ratio={traced / ours:.3f}  (target >= 0.75)")
            sdk_traced = statistics.median(runs["tracing_sdk"])
            print(f"hermes-gateway + tracing with the SDK's own tracer (HERMES_LEAN_SPANS=0): {sdk_traced:,.0f} calls/s")
            print(f"sdk_tracing_ratio={sdk_traced / ours:.3f}  (lean spans pay where this is below tracing_ratio)")
        print(f"ratio_vs_rq={ours / rq_rate:.2f}")


if __name__ == "__main__":
    main()
