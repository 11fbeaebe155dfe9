"""End-to-end throughput of no-op calls at the settings users run, beside Dramatiq and stock RQ in one run.

Rows, each figure from a fresh set of warm worker processes, rows interleaved round by round (medians):

- ``8x8``: ours, one worker process with 8 call slots, tool limit 8, the default log level (INFO, two
  lines a call); also p50/p99 of calls made one at a time;
- ``8x5``: the same with the seed's default limit (5 per tool: the limit-bound path);
- ``8x8_warning``: ``8x8`` at ``HERMES_LOG_LEVEL=WARNING``, so what the INFO lines cost shows;
- ``64``: 64 slots, no limit in effect, WARNING: the row this benchmark printed before issue #30;
- ``dramatiq``: Dramatiq, 1 process x 8 threads, a no-op actor (``bench/dramatiq_actors.py``), done when
  acked (it stores no result);
- ``rq``: stock RQ ``SimpleWorker``, one process (a quarter of the calls: it is slow).

Ours is timed from the first enqueue to the last ``done`` event seen by the caller. Beside calls/s, each
figure has CPU per call of Redis (``INFO cpu`` before and after), of the worker processes (and their
children) and of this process (the caller): CPU time moves far less than calls/s when other processes
share the machine. ``--with stock,plugins,tracing`` adds the older 64-slot variants. Without ``--url``
and ``$HERMES_REDIS_URL`` a private Redis is started, so its CPU figure is ours alone.

Results are written to ``bench/results/throughput-<date>-<commit>.json``; the last line printed is
``ratio_vs_dramatiq=<x>`` (``8x8`` / ``dramatiq``, the median of the per-round ratios).
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
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
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
    using_broker,
    wait_for_workers,
)

EXAMPLE_PLUGINS = ROOT / "examples" / "plugins"
SEED_PLUGINS = [
    "middleware-demo-llm-tag",
    "middleware-demo-terminal-workdir",
    "middleware-demo-llm-timing",
    "middleware-demo-tool-annotate",
]
NO_LIMIT = 100_000
BATCH = 500  # calls per pipelined submission


@dataclass
class Sample:
    """One figure: calls/s and CPU per call (µs) of Redis, the workers and the caller; latency when taken."""

    calls_per_s: float
    redis_us: float
    worker_us: float
    client_us: float
    # Context switches per call (voluntary and not, all threads): each is a wakeup, whose cost varies
    # far more between machines than a CPU's speed does (a loopback round trip took 25 µs on one machine
    # and 120 µs on the same kind another day).
    redis_cs: float | None = None
    worker_cs: float | None = None
    client_cs: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    # Commands Redis ran per call, the ones scripts call counted one by one (INFO commandstats): the
    # figure for Redis's work that does not move with the machine's speed or load.
    redis_cmds: float | None = None


def switches(pid: int) -> int | None:
    """Context switches so far of every live thread of process ``pid`` (None: no such process here)."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return None
    total = 0
    for status in tasks.glob("*/status"):
        try:
            for line in status.read_text().splitlines():
                if "ctxt_switches:" in line:  # voluntary_ and nonvoluntary_
                    total += int(line.split()[-1])
        except (OSError, ValueError):
            pass  # (a thread that ended meanwhile)
    return total


def _redis_pid(conn: Any) -> int | None:
    """The Redis server's pid when it runs on this machine (its ``process_id`` names a redis-server here)."""
    pid = int(conn.info("server").get("process_id") or 0)
    try:
        return pid if Path(f"/proc/{pid}/comm").read_text().startswith("redis") else None
    except OSError:
        return None


class Cpu:
    """CPU seconds so far of this process, the given processes (and their children) and the Redis server;
    and their context switches (``switches_read``; Redis's only when it runs on this machine)."""

    def __init__(self, conn: Any, procs: list[subprocess.Popen[bytes]]) -> None:
        import psutil

        self.conn = conn
        self.procs = []
        for p in procs:  # (children now: Dramatiq's worker processes are its master's children)
            parent = psutil.Process(p.pid)
            self.procs += [parent, *parent.children(recursive=True)]
        self.redis_pid = _redis_pid(conn)

    def switches_read(self) -> tuple[float, float, float]:
        """(Redis, workers, this process); NaN where a count cannot be read here."""
        nan = float("nan")
        redis = switches(self.redis_pid) if self.redis_pid else None
        workers = [switches(p.pid) for p in self.procs]
        own = switches(os.getpid())
        return (
            nan if redis is None else float(redis),
            nan if None in workers else float(sum(w or 0 for w in workers)),
            nan if own is None else float(own),
        )

    def read(self) -> tuple[float, float, float]:
        import psutil

        workers = 0.0
        for p in self.procs:
            try:
                workers += sum(p.cpu_times()[:2])
            except psutil.Error:
                pass
        own = sum(psutil.Process().cpu_times()[:2])
        info = self.conn.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"]), workers, own

    def commands(self) -> int:
        """Commands Redis has run so far (every client's, and each command a script called)."""
        return sum(int(v.get("calls", 0)) for k, v in self.conn.info("commandstats").items() if isinstance(v, dict))

    def start(self) -> None:
        """Mark where a figure starts: commands, context switches, CPU and the time so far."""
        self._marks = (self.commands(), self.switches_read(), self.read(), time.perf_counter())

    def sample(self, n: int) -> Sample:
        """The figure of ``n`` calls since ``start``: calls/s, and per call CPU (µs), switches and commands."""
        cmds0, switched0, before, start = self._marks
        elapsed, after, cmds1, switched1 = time.perf_counter() - start, self.read(), self.commands(), self.switches_read()
        redis, workers, own = ((b - a) / n * 1e6 for a, b in zip(before, after, strict=True))
        sample = Sample(n / elapsed, redis, workers, own, redis_cmds=(cmds1 - cmds0) / n)
        cs = [(b - a) / n for a, b in zip(switched0, switched1, strict=True)]
        sample.redis_cs, sample.worker_cs, sample.client_cs = (None if v != v else v for v in cs)
        return sample


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered) * 1e3, p99 * 1e3


# -- ours -----------------------------------------------------------------------------------------------


def run_ours(
    url: str,
    n: int,
    slots: int,
    limit: int | None,
    log_level: str = "INFO",
    latency: int = 0,
    plugins: list[str] | None = None,
    tracing: bool = False,
    lean: bool = True,
    fast_path: bool = True,
    shortcuts_off: tuple[str, ...] = (),
) -> Sample:
    """``n`` no-op calls through one worker process with ``slots`` call slots and a tool limit of ``limit``
    (None: the executor's default, the seed's 5); then ``latency`` calls one at a time.

    ``tracing``: a real SDK pipeline (batch processor into memory) on both sides; ``fast_path`` False:
    redis-py's stock pipelines and pub/sub reads (``broker.fast_path``); ``shortcuts_off``: the workers'
    ``workers.shortcuts_off`` (bench/shortcuts.py)."""
    from broker.config import load_settings
    from broker.connection import from_url
    from hermes_gateway import Gateway
    from hermes_gateway.client import BrokerHandle

    queue = f"bench-{uuid.uuid4().hex[:8]}"
    tool: dict[str, Any] = {
        "name": f"noop_{queue.replace('-', '_')}",
        "executor": "python",
        "function": "workers.executors.builtin:noop",
        "queue_size": 1_000_000,
        "queue": queue,
    }
    if limit is not None:
        tool["concurrency"] = limit
    config: dict[str, Any] = {"plugins": {"enabled": plugins}} if plugins else {}
    config["broker"] = {"fast_path": fast_path}  # (read by the workers and this client from config.yaml)
    if shortcuts_off:
        config["workers"] = {"shortcuts_off": list(shortcuts_off)}
    home = scratch_home([tool], config)
    for name in plugins or []:
        shutil.copytree(EXAMPLE_PLUGINS / name, home / "plugins" / name)
    conn = from_url(url)
    env = {"HERMES_TRACE": "memory", "HERMES_LEAN_SPANS": "1" if lean else "0"} if tracing else {}
    procs = start_workers(url, home, queue, 1, slots, env, log_level=log_level)
    if tracing:
        _client_tracing(True)
    try:
        wait_for_workers(conn, 1, queue)
        gw = Gateway(BrokerHandle(from_url(url), url, url), load_settings(home))
        gw.sync_tools(home / "tools")
        name = str(tool["name"])
        for h in gw.map(name, [{}] * 40):  # warm: imported, connected, scripts loaded
            h.result(30)
        cpu = Cpu(conn, procs)
        cpu.start()
        handles: list[Any] = []
        for i in range(0, n, BATCH):
            handles.extend(gw.map(name, [{}] * min(BATCH, n - i)))
        for h in handles:
            h.result(120)
        sample = cpu.sample(n)
        if latency:
            times = []
            for i in range(20 + latency):
                t0 = time.perf_counter()
                gw.call_tool(name, {}).result(30)
                if i >= 20:
                    times.append(time.perf_counter() - t0)
            sample.p50_ms, sample.p99_ms = percentiles(times)
        gw.close()
        return sample
    finally:
        if tracing:
            _client_tracing(False)
        stop(procs)
        conn.close()
        shutil.rmtree(home, ignore_errors=True)


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


# -- peers ----------------------------------------------------------------------------------------------


def run_dramatiq(url: str, n: int, threads: int = 8) -> Sample:
    """``n`` messages to a no-op actor, one Dramatiq process with ``threads`` threads; done when acked."""
    from broker.connection import from_url

    queue = f"dq-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, BENCH_DRAMATIQ_URL=url, BENCH_DRAMATIQ_QUEUE=queue, PYTHONPATH=str(ROOT))
    log = (Path(os.environ.get("TMPDIR", "/tmp")) / f"{queue}.log").open("wb")
    cmd = [sys.executable, "-m", "dramatiq", "bench.dramatiq_actors", "--processes", "1", "--threads", str(threads)]
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log)]
    # The sender: this process, with the same queue name (the module reads it at import).
    os.environ.update(BENCH_DRAMATIQ_URL=url, BENCH_DRAMATIQ_QUEUE=queue)
    sys.modules.pop("bench.dramatiq_actors", None)
    import bench.dramatiq_actors as actors

    conn = from_url(url)
    pending = f"dramatiq:{queue}.msgs"
    try:
        for _ in range(40):
            actors.noop.send()
        _until_empty(conn, pending, procs)
        cpu = Cpu(conn, procs)
        cpu.start()
        for _ in range(n):
            actors.noop.send()
        _until_empty(conn, pending, procs)
        return cpu.sample(n)
    finally:
        stop(procs)
        log.close()
        actors.broker.close()
        conn.delete(f"dramatiq:{queue}", pending)
        conn.close()


def _until_empty(conn: Any, key: str, procs: list[subprocess.Popen[bytes]], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while conn.hlen(key):
        if time.monotonic() > deadline or procs[0].poll() is not None:
            raise RuntimeError(f"Dramatiq did not finish its messages ({key})")
        time.sleep(0.002)


def run_rq(url: str, n: int) -> Sample:
    """``n`` no-op jobs through one stock RQ ``SimpleWorker``; done when in the finished registry."""
    from rq import Queue

    from broker.connection import from_url

    conn = from_url(url)
    queue_name = f"rqbench-{uuid.uuid4().hex[:8]}"
    q = Queue(queue_name, connection=conn)
    procs = start_rq_workers(url, queue_name, 1)
    try:
        wait_for_workers(conn, 1, queue_name)
        jobs = q.enqueue_many([Queue.prepare_data("bench.rqjobs.noop") for _ in range(10)])
        _wait_finished(q, len(jobs))
        base = q.finished_job_registry.count
        cpu = Cpu(conn, procs)
        cpu.start()
        for i in range(0, n, BATCH):
            q.enqueue_many([Queue.prepare_data("bench.rqjobs.noop") for _ in range(min(BATCH, n - i))])
        _wait_finished(q, base + n)
        return cpu.sample(n)
    finally:
        stop_rq(procs)
        conn.close()


def _wait_finished(q: Any, count: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while q.finished_job_registry.count < count:
        if time.monotonic() > deadline:
            raise RuntimeError("stock RQ did not finish in time")
        time.sleep(0.01)


# -- the run --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    run: Callable[[str, int], Sample]
    calls: float = 1.0  # share of --calls this row runs


def rows(latency: int) -> list[Row]:
    return [
        Row("8x8", "ours 8 slots, limit 8, INFO (default)", lambda u, n: run_ours(u, n, 8, 8, latency=latency)),
        Row("8x5", "ours 8 slots, limit 5 (seed default), INFO", lambda u, n: run_ours(u, n, 8, None)),
        Row("8x8_warning", "ours 8 slots, limit 8, WARNING", lambda u, n: run_ours(u, n, 8, 8, "WARNING")),
        Row("64", "ours 64 slots, no limit, WARNING", lambda u, n: run_ours(u, n, 64, NO_LIMIT, "WARNING")),
        Row("dramatiq", "Dramatiq 1 process x 8 threads", run_dramatiq),
        Row("rq", "stock RQ SimpleWorker, 1 process", run_rq, 0.25),
    ]


def extra_rows() -> list[Row]:
    return [
        Row("stock", "64 slots, redis-py's stock pipelines, WARNING",
            lambda u, n: run_ours(u, n, 64, NO_LIMIT, "WARNING", fast_path=False)),
        Row("plugins", "64 slots + the seed's 4 example plugins, WARNING",
            lambda u, n: run_ours(u, n, 64, NO_LIMIT, "WARNING", plugins=SEED_PLUGINS)),
        Row("tracing", "64 slots + tracing (SDK, batch, in memory), WARNING",
            lambda u, n: run_ours(u, n, 64, NO_LIMIT, "WARNING", tracing=True)),
        Row("tracing_sdk", "64 slots + tracing with the SDK's own tracer, WARNING",
            lambda u, n: run_ours(u, n, 64, NO_LIMIT, "WARNING", tracing=True, lean=False)),
    ]


def _commit() -> tuple[str, bool]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))


def _ratio(runs: dict[str, list[Sample]], top: str, bottom: str) -> list[float]:
    """Per-round ratios of calls/s (same round, so the same spell of the machine)."""
    return [a.calls_per_s / b.calls_per_s for a, b in zip(runs[top], runs[bottom], strict=False)]


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--latency-calls", type=int, default=200, help="one-at-a-time calls of the 8x8 row")
    parser.add_argument("--url", default=None, help="Redis URL (default $HERMES_REDIS_URL, else a private one)")
    parser.add_argument("--only", default="", help="comma-separated row keys to run (default: all)")
    parser.add_argument("--with", dest="extra", default="", help="also: stock,plugins,tracing (64-slot variants)")
    parser.add_argument("--out", default=None, help="result JSON path (default bench/results/throughput-...)")
    args = parser.parse_args()
    chosen = rows(args.latency_calls)
    extras = {x.strip() for x in args.extra.split(",") if x.strip()}
    chosen += [r for r in extra_rows() if r.key.split("_")[0] in extras]
    if args.only:
        only = {x.strip() for x in args.only.split(",")}
        chosen = [r for r in chosen if r.key in only]
    runs: dict[str, list[Sample]] = {r.key: [] for r in chosen}
    load0 = os.getloadavg()
    with using_broker(args.url) as url:
        private = not (args.url or os.environ.get("HERMES_REDIS_URL"))
        from broker.connection import from_url

        redis_version = from_url(url).info("server").get("redis_version")
        print(f"broker: {'private Redis ' + str(redis_version) if private else url}; {args.calls} no-op calls a "
              f"figure; {args.rounds} interleaved rounds; nproc {os.cpu_count()}; load {load0[0]:.2f}")
        if not private:
            print("  (a shared Redis: its CPU per call includes other clients')")
        for r in range(args.rounds):
            # Interleaved, and each round starts at another row: slow and fast spells fall on every row alike.
            order = chosen[r % len(chosen):] + chosen[: r % len(chosen)]
            for row in order:
                runs[row.key].append(row.run(url, max(1, int(args.calls * row.calls))))
            print(f"round {r + 1}: " + ", ".join(f"{row.key} {runs[row.key][-1].calls_per_s:,.0f}/s" for row in chosen))
    load1 = os.getloadavg()
    medians = {k: {f: statistics.median(getattr(s, f) for s in v) if all(getattr(s, f) is not None for s in v)
                   else None for f in Sample.__dataclass_fields__} for k, v in runs.items() if v}
    print(f"{'row':<46} {'calls/s':>8} {'range':>13} {'Redis µs':>9} {'worker µs':>10} {'caller µs':>10}"
          f" {'p50/p99 ms':>11} {'switches':>14} {'cmds':>5}   (CPU per call; context switches per call: Redis/worker/caller;"
          f" Redis commands per call; medians)")
    for row in chosen:
        m, v = medians[row.key], [s.calls_per_s for s in runs[row.key]]
        lat = f"{m['p50_ms']:.2f}/{m['p99_ms']:.2f}" if m["p50_ms"] is not None else "-"
        cs = "/".join(f"{m[f]:.1f}" if m[f] is not None else "-" for f in ("redis_cs", "worker_cs", "client_cs"))
        cmds = f"{m['redis_cmds']:.1f}" if m["redis_cmds"] is not None else "-"
        print(f"{row.label:<46} {m['calls_per_s']:>8,.0f} {min(v):>6,.0f}-{max(v):<6,.0f} {m['redis_us']:>9.0f}"
              f" {m['worker_us']:>10.0f} {m['client_us']:>10.0f} {lat:>11} {cs:>14} {cmds:>5}")
    ratios: dict[str, list[float]] = {}
    for name, top, bottom in (
        ("ratio_vs_dramatiq", "8x8", "dramatiq"),
        ("limit5_vs_dramatiq", "8x5", "dramatiq"),
        ("info_vs_warning", "8x8", "8x8_warning"),
        ("ratio_vs_rq", "8x8", "rq"),
        ("plugins_ratio", "plugins", "64"),
        ("tracing_ratio", "tracing", "64"),
        ("stock_path_ratio", "stock", "64"),
    ):
        if runs.get(top) and runs.get(bottom):
            ratios[name] = _ratio(runs, top, bottom)
    commit, dirty = _commit()
    result = {
        "bench": "throughput",
        "commit": commit,
        "dirty": dirty,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nproc": os.cpu_count(),
        "loadavg_start_end": [round(load0[0], 2), round(load1[0], 2)],
        "python": platform.python_version(),
        "redis": redis_version,
        "private_redis": private,
        "calls": args.calls,
        "rounds": args.rounds,
        "rows": {r.key: {"label": r.label, "median": medians[r.key], "runs": [asdict(s) for s in runs[r.key]]}
                 for r in chosen},
        "ratios": {k: {"median": statistics.median(v), "min": min(v), "rounds": v} for k, v in ratios.items()},
    }
    out = Path(args.out) if args.out else RESULTS / f"throughput-{time.strftime('%Y%m%d-%H%M%S')}-{commit[:7]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {shown(out)}")
    for name, v in ratios.items():
        if name != "ratio_vs_dramatiq":
            print(f"{name}={statistics.median(v):.3f} (per round: {', '.join(f'{x:.2f}' for x in v)})")
    if "ratio_vs_dramatiq" in ratios:
        v = ratios["ratio_vs_dramatiq"]
        print(f"8x8 / Dramatiq per round: {', '.join(f'{x:.2f}' for x in v)} (goal: >= 1.3 in every round)")
        print(f"ratio_vs_dramatiq={statistics.median(v):.2f}")


if __name__ == "__main__":
    main()
