"""Each speed shortcut on and off, on the per-call work it speeds up, in one process on one Redis.

A row per shortcut (docs/ARCHITECTURE.md "Why it is fast"; docs/decisions.md for the ones removed):

- ``threads``: a call handed to a worker's call threads (at most 8 in flight, as a worker's tokens allow),
  against a ``ThreadPoolExecutor``;
- ``quickcheck``: a tool's arguments checked against a plain three-property schema, against the full
  JSON Schema validator alone;
- ``frozen``: the envelope a worker decodes and the audit record it builds for a call, against their
  dataclass ``__init__``;
- ``redaction``: a call's two log lines through the redaction processor, against ``RedactProcessor``;
- ``pipes``: an outbox-sized pipeline of four script calls sent to Redis by ``broker.pipes``, against
  redis-py's ``Pipeline.execute`` (``broker.fast_path``);
- ``claim``: a worker dispatcher's claim on the connection it keeps, sent by ``broker.pipes``, against
  redis-py's ``Script.__call__`` (``broker.fast_path``);
- ``lean_spans``: a call's three nested spans on the lean tracer, against the SDK's (``telemetry.lean_spans``).

Rounds are interleaved (each round measures every row both ways, the order alternating), and each figure
is the median over rounds of microseconds per operation; a row's ratio is off/on (above 1: the shortcut
pays), with the lowest and highest per-round ratio beside it as its noise. The machine is shared: the JSON
(``bench/results/shortcuts-<date>-<commit>.json``) records the load average before and after. Then, end
to end, all of them on against all off through a real worker process (``--e2e-calls``, ``--e2e-rounds``;
worker CPU per call, off/on). The last line printed is ``shortcuts_ratio=<x>``, the geometric mean of the
rows' ratios.

    python bench/shortcuts.py [--url redis://127.0.0.1:6379/15] [--rounds 7] [--e2e-calls 1000]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, ROOT, using_broker  # noqa: E402

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

# (run n operations and return the seconds they took, turn the shortcut on or off)
Row = tuple[Callable[[int], float], Callable[[bool], None]]


def _switch(name: str) -> Callable[[bool], None]:
    from broker.settings import configure_shortcuts

    def turn(on: bool) -> None:
        configure_shortcuts(() if on else (name,))

    return turn


def threads_row() -> Row:
    from workers.worker import call_threads

    def run(n: int) -> float:
        pool = call_threads(8, "bench")
        slots = threading.Semaphore(8)
        done = threading.Semaphore(0)

        def task(_: Any) -> None:
            slots.release()
            done.release()

        started = time.perf_counter()
        for _ in range(n):
            slots.acquire()
            pool.submit(task, None)
        for _ in range(n):
            done.acquire()
        took = time.perf_counter() - started
        pool.shutdown()
        return took

    return run, _switch("threads")


SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "minLength": 1},
        "limit": {"type": "integer", "minimum": 1},
        "recursive": {"type": "boolean"},
    },
    "required": ["path"],
}


def quickcheck_row() -> Row:
    from workers.args import validate_args

    args = {"path": "/srv/data/report.csv", "limit": 10, "recursive": False}

    def run(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            validate_args(SCHEMA, args, "bench")
        return time.perf_counter() - started

    return run, _switch("quickcheck")


def frozen_row() -> Row:
    from broker.audit import AuditRecord
    from broker.envelope import Envelope

    data = Envelope(
        call_id="{tools}.9f2c0a11b2c3d4e5", kind="tool", tool="echo", args={"text": "hello"},
        traceparent=TP, queue="tools", channel="hermes:ch:bench",
    ).to_dict()  # fmt: skip

    def run(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            env = Envelope.from_dict(data)
            AuditRecord.of(call_id=env.call_id, kind="tool", state="done", tool_name=env.tool, args=env.args, result="hi")
        return time.perf_counter() - started

    return run, _switch("frozen")


def redaction_row() -> Row:
    from broker.logs import redact_event

    bound = {"call_id": "{tools}.9f2c0a11b2c3d4e5f60718293a4b5c6d", "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
             "span_id": "00f067aa0ba902b7", "tool": "echo", "timestamp": "2026-12-06T02:00:00.000000Z", "level": "info"}  # fmt: skip
    lines = ({**bound, "event": "call started", "queue_wait_ms": 1.4},
             {**bound, "event": "call finished", "state": "done", "duration_ms": 2.7})  # fmt: skip

    def run(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            for line in lines:
                redact_event(None, "info", dict(line))
        return time.perf_counter() - started

    return run, _switch("redaction")


def pipes_row(url: str) -> Row:
    import redis

    from broker import pipes

    conn = redis.Redis.from_url(url)
    script = conn.register_script("return ARGV[1]")
    script(keys=["hermes:bench:shortcuts"], args=["x"])  # (loaded: neither way pays a NOSCRIPT)

    def run(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            pipe = conn.pipeline(transaction=False)
            for i in range(4):
                pipes.script(script, ["hermes:bench:shortcuts"], [i], client=pipe)
            pipes.execute(pipe)
        return time.perf_counter() - started

    return run, pipes.configure


def claim_row(url: str) -> Row:
    import redis

    from broker import pipes
    from broker.calls import Calls

    conn = redis.Redis.from_url(url)
    calls = Calls(conn)
    kept = conn.connection_pool.get_connection()
    calls.claim(["hermes-bench-shortcuts"], 8, "bench", 30)  # (loaded: neither way pays a NOSCRIPT)

    def run(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):  # (an empty queue: the claim's own cost, the work of the script aside)
            calls.claim(["hermes-bench-shortcuts"], 8, "bench", 30, kept)
        return time.perf_counter() - started

    return run, pipes.configure


def lean_spans_row() -> Row:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    from broker.otel import SCOPE
    from workers.spans import Provider

    tracers = {}
    for lean, kind in ((True, Provider), (False, TracerProvider)):
        provider = kind(shutdown_on_exit=False)
        provider.add_span_processor(SpanProcessor())  # (a processor that keeps nothing: the span work alone)
        tracers[lean] = provider.get_tracer(SCOPE)
    current = [tracers[True]]
    attrs: dict[str, str | int] = {"hermes.call_id": "{tools}.9f2c0a11", "hermes.tool": "echo", "hermes.attempt": 1}

    def run(n: int) -> float:
        tracer = current[0]
        started = time.perf_counter()
        for _ in range(n):
            with tracer.start_as_current_span("tool echo", attributes=attrs):
                with tracer.start_as_current_span("hermes.queue"):
                    pass
                with tracer.start_as_current_span("hermes.execute", attributes={"hermes.executor": "python"}):
                    pass
        return time.perf_counter() - started

    def turn(on: bool) -> None:
        current[0] = tracers[on]

    return run, turn


def _calibrate(run: Callable[[int], float], seconds: float) -> int:
    """Operations that take about ``seconds`` with the shortcut on (after a warm-up)."""
    n = 50
    while True:
        took = run(n)
        if took >= seconds / 4 or n >= 1_000_000:
            return max(50, int(n * seconds / max(took, 1e-6)))
        n *= 4


def measure(rows: dict[str, Row], rounds: int, seconds: float) -> dict[str, Any]:
    sizes = {}
    for name, (run, turn) in rows.items():
        turn(True)
        sizes[name] = _calibrate(run, seconds)
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
    for r in range(rounds):
        for name, (run, turn) in rows.items():
            both: dict[str, float] = {}
            for on in (True, False) if r % 2 == 0 else (False, True):
                turn(on)
                both["on" if on else "off"] = run(sizes[name]) / sizes[name] * 1e6
            turn(True)
            per_round[name].append(both)
    out: dict[str, Any] = {}
    for name, figures in per_round.items():
        ratios = [f["off"] / f["on"] for f in figures]
        on_us = statistics.median(f["on"] for f in figures)
        off_us = statistics.median(f["off"] for f in figures)
        out[name] = {
            "ops_per_round": sizes[name],
            "on_us": round(on_us, 3),
            "off_us": round(off_us, 3),
            "saved_us": round(off_us - on_us, 3),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_low": round(min(ratios), 3),
            "ratio_high": round(max(ratios), 3),
            "rounds": [{k: round(v, 3) for k, v in f.items()} for f in figures],
        }
    return out


def end_to_end(url: str, calls: int, rounds: int) -> dict[str, Any]:
    """Every shortcut on, then every one off (fast path and lean spans too), through one real worker process
    (8 slots, tracing into memory on both sides, INFO lines): ``bench/throughput.py``'s no-op calls,
    interleaved rounds. The tool has no input schema, so ``quickcheck`` does not show here."""
    from bench.throughput import run_ours
    from broker.settings import SHORTCUTS as NAMES

    per_round: list[dict[str, dict[str, float]]] = []
    for r in range(rounds):
        both: dict[str, dict[str, float]] = {}
        for on in (True, False) if r % 2 == 0 else (False, True):
            sample = run_ours(
                url, calls, 8, None, tracing=True, lean=on, fast_path=on, shortcuts_off=() if on else NAMES
            )
            both["on" if on else "off"] = {"calls_per_s": sample.calls_per_s, "worker_us": sample.worker_us}
        per_round.append(both)
    # (a round too short for the CPU clock's tick reads 0 µs: no ratio from it)
    ratios = [f["off"]["worker_us"] / f["on"]["worker_us"] for f in per_round if f["on"]["worker_us"] > 0]
    return {
        "calls_per_round": calls,
        "on_calls_per_s": round(statistics.median(f["on"]["calls_per_s"] for f in per_round), 1),
        "off_calls_per_s": round(statistics.median(f["off"]["calls_per_s"] for f in per_round), 1),
        "on_worker_us": round(statistics.median(f["on"]["worker_us"] for f in per_round), 1),
        "off_worker_us": round(statistics.median(f["off"]["worker_us"] for f in per_round), 1),
        "worker_cpu_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "worker_cpu_ratio_low": round(min(ratios), 3) if ratios else None,
        "worker_cpu_ratio_high": round(max(ratios), 3) if ratios else None,
        "rounds": [{k: {m: round(v, 1) for m, v in d.items()} for k, d in f.items()} for f in per_round],
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="Redis URL (default: $HERMES_REDIS_URL, else an embedded broker)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.3, help="about how long one measurement takes")
    parser.add_argument(
        "--e2e-calls", type=int, default=1000, help="calls per end-to-end figure (0: no end-to-end row)"
    )
    parser.add_argument("--e2e-rounds", type=int, default=5)
    parser.add_argument("--only", help="comma-separated rows to run (default: all)")
    parser.add_argument("--out", help="result file (default: bench/results/shortcuts-<date>-<commit>.json)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    with using_broker(args.url) as url:
        rows: dict[str, Row] = {
            "threads": threads_row(),
            "quickcheck": quickcheck_row(),
            "frozen": frozen_row(),
            "redaction": redaction_row(),
            "pipes": pipes_row(url),
            "claim": claim_row(url),
            "lean_spans": lean_spans_row(),
        }
        if args.only:
            rows = {name: row for name, row in rows.items() if name in args.only.split(",")}
        figures = measure(rows, args.rounds, args.seconds)
        e2e = end_to_end(url, args.e2e_calls, args.e2e_rounds) if args.e2e_calls > 0 else None
    summary = math.exp(statistics.fmean(math.log(f["ratio"]) for f in figures.values()))
    commit = _commit()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    result = {
        "bench": "shortcuts",
        "commit": commit,
        "date": stamp,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "rounds": args.rounds,
        "unit": "microseconds per operation, median of rounds; ratio = off/on",
        "rows": figures,
        "end_to_end": e2e,
        "shortcuts_ratio": round(summary, 3),
    }
    path = Path(args.out) if args.out else RESULTS / f"shortcuts-{stamp}-{commit or 'nocommit'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'shortcut':<12} {'on µs':>9} {'off µs':>9} {'saved µs':>9} {'off/on':>7}  (lowest-highest round)")
    for name, f in figures.items():
        print(
            f"{name:<12} {f['on_us']:>9.2f} {f['off_us']:>9.2f} {f['saved_us']:>9.2f} {f['ratio']:>7.2f}"
            f"  ({f['ratio_low']:.2f}-{f['ratio_high']:.2f})"
        )
    if e2e is not None:
        print(
            f"end to end, all on / all off: {e2e['on_calls_per_s']:,.0f} / {e2e['off_calls_per_s']:,.0f} calls/s, "
            f"worker CPU {e2e['on_worker_us']:.0f} / {e2e['off_worker_us']:.0f} µs a call, off/on "
            + (f"{e2e['worker_cpu_ratio']:.2f} ({e2e['worker_cpu_ratio_low']:.2f}-{e2e['worker_cpu_ratio_high']:.2f})"
               if e2e["worker_cpu_ratio"] is not None else "n/a (rounds too short for the CPU clock)")
        )
    print(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; written to {path}")
    print(f"shortcuts_ratio={summary:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
