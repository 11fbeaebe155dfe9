"""``hermes-gateway demo``: a broker, a worker pool, a live batch, and a summary.

The broker is ``HERMES_REDIS_URL``, else that of a ``serve`` (or ``worker``) of this ``$HERMES_HOME``
running here (its console shows the demo's calls), else an embedded one that ends with the demo. On a
shared broker the demo touches nothing of the user's (its tools are ``demo_*`` on a queue of their own)
and leaves nothing behind: its unfinished calls are cancelled and its tools removed before its workers stop.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from broker.config import Settings
from hermes_gateway.client import Gateway
from hermes_gateway.demo_tools import CITIES
from hermes_gateway.handle import CallHandle
from hermes_gateway.local import connect_local, wait_for_heartbeats
from workers.pool import spawn, stop_all

QUEUE = "demo"
HELLO, WEATHER = "demo_hello", "demo_get_weather"  # (a tool name is [A-Za-z0-9_-]: OpenAI's function names)
LEAVE_WITHIN = 15.0  # seconds the demo waits for its cancelled calls to end before it stops its workers

DEMO_TOOLS: list[dict[str, Any]] = [
    {
        "name": HELLO, "description": "Greet someone by name", "executor": "command",
        "command": "echo Hello, {{name}}!",
        "input_schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        "timeout": 10, "concurrency": 20, "queue": QUEUE,
    },
    {
        "name": WEATHER, "description": "查询指定城市的实时天气情况", "executor": "python",
        "function": "hermes_gateway.demo_tools:weather",
        "input_schema": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        }, "required": ["city"]},
        "timeout": 10, "concurrency": 50, "queue": QUEUE,
    },
]
ATLANTIS = "Atlantis"  # the demo's failures on purpose: the weather tool has no station there
NAMES = ["Alice", "Bob", "Chen", "Dana", "Émile", "Farah"]


def _batch(n: int, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(n):
        if i % 4 == 0:
            out.append((HELLO, {"name": rng.choice(NAMES)}))
        elif i % 50 == 7:
            out.append((WEATHER, {"city": ATLANTIS}))  # fails on purpose: no such station
        else:
            out.append((WEATHER, {"city": rng.choice(CITIES), "unit": rng.choice(["celsius", "fahrenheit"])}))
    return out


def _latency(h: CallHandle) -> float | None:
    evs = [e for e in h.seen if e.type == "transition"]
    return (evs[-1].ts - evs[0].ts) * 1000 if len(evs) >= 2 else None


def run_demo(settings: Settings, *, calls: int, processes: int, concurrency: int) -> int:
    console = Console(width=max(110, Console().width))
    handle, attached = connect_local(settings)
    console.print(f"[bold]broker[/bold]: {handle.description}")
    if attached is None and handle.embedded is not None:
        console.print(
            "  (its own, gone when the demo ends: start `hermes-gateway serve` first to watch the calls in its console)"
        )
    gw = Gateway(handle, settings)
    # The children's environment: ours, logging errors only (failures show in the summary, not as log lines).
    env = dict(os.environ, HERMES_LOG_LEVEL="ERROR")
    procs = [spawn(handle.url, [QUEUE], concurrency, env=env) for _ in range(processes)]
    handles: list[CallHandle] = []  # every call of the demo, so that it can leave none behind
    try:
        wait_for_heartbeats(gw, processes)
        for spec in DEMO_TOOLS:
            gw.register_tool(spec)
        console.print(f"[bold]workers[/bold]: {processes} processes x {concurrency} calls in flight on queue {QUEUE!r}")
        console.print("[bold]tools[/bold]: " + ", ".join(s["name"] for s in DEMO_TOOLS))

        console.rule("one call, live")
        one = gw.call_tool(WEATHER, {"city": "北京"}, session_id="demo-session")
        handles.append(one)
        for ev in one.events(timeout=30):
            what = ev.state if ev.type == "transition" else f"  {ev.type}: {ev.detail.get('message', '')}"
            console.print(f"  seq={ev.seq} {what:<40} trace_id={ev.trace_id}")
        console.print(f"  result: {one.result(30)}")

        console.rule(f"a batch of {calls} calls")
        work = _batch(calls, random.Random(10))
        failing = sum(1 for name, args in work if args.get("city") == ATLANTIS)
        if failing:
            console.print(f"  {failing} of them ask for the weather in {ATLANTIS!r}, which fails on purpose (executor_error)")
        start = time.perf_counter()
        with _ctrl_c_after() as interrupted:  # a Ctrl-C mid-submission: once its handles are known, to cancel
            batch = gw.submit_many(work, session_id="demo-session")
            handles += batch
        if interrupted:
            raise KeyboardInterrupt
        columns = (TextColumn("calls"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as bar:
            task = bar.add_task("calls", total=len(batch))
            while True:
                finished = sum(1 for h in batch if h.done())
                bar.update(task, completed=finished)
                if finished == len(batch):
                    break
                time.sleep(0.05)
        wall = time.perf_counter() - start

        outcomes: Counter[str] = Counter()
        for h in batch:
            try:
                h.result(0)
                outcomes["done"] += 1
            except Exception as e:  # noqa: BLE001 - the summary counts every kind of failure
                outcomes[f"failed ({getattr(e, 'type', type(e).__name__)})"] += 1
        lat = sorted(x for x in (_latency(h) for h in batch) if x is not None)
        table = Table("metric", Column("value", justify="right"), title="summary", title_justify="left")
        table.add_row("calls", str(len(batch)))
        for k, v in sorted(outcomes.items()):
            table.add_row(k, str(v))
        if failing:
            table.add_row(f"  of them on purpose (city {ATLANTIS!r})", str(failing))
        table.add_row("wall time", f"{wall:.2f} s")
        table.add_row("throughput", f"{len(batch) / wall:,.0f} calls/s")
        if lat:
            table.add_row("latency p50", f"{statistics.median(lat):.1f} ms")
            table.add_row("latency p99", f"{lat[min(len(lat) - 1, int(len(lat) * 0.99))]:.1f} ms")
        console.print(table)

        headers = ("worker", "pid", "queues", "concurrency", "ran (this demo)", "failed")
        topo = Table(*headers, title="topology", title_justify="left")
        ran: Counter[str] = Counter()  # calls of the demo per worker, and those of them that failed
        failed: Counter[str] = Counter()
        for h in handles:
            worker = next((e.detail.get("worker") for e in h.seen if e.state == "routing"), None)
            if worker:
                ran[worker] += 1
                failed[worker] += h.final_state == "failed"
        for w in gw.live_workers(QUEUE):
            name = w.get("name", "")
            row = (name, w.get("pid", ""), w.get("queues", ""), w.get("concurrency", ""), ran[name], failed[name])
            topo.add_row(*map(str, row))
        console.print(topo)
        console.print(f"broker: {handle.description}")
        return 0
    finally:
        try:
            _leave(gw, handles, console)
        finally:
            stop_all(procs)
            gw.close()


@contextmanager
def _ctrl_c_after() -> Iterator[list[int]]:
    """Hold SIGINT until the block ends (the list it gives is then non-empty): the block's calls are in
    Redis before their handles are, so an interrupt inside would leave calls the demo cannot cancel."""
    held: list[int] = []  # (the demo runs on the CLI's main thread, where signal handlers can be set)
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)


def _leave(gw: Gateway, handles: list[CallHandle], console: Console) -> None:
    """Leave the broker as the demo found it: cancel its unfinished calls (while its workers still run, so a
    running one is stopped by its worker), wait for them to end, and remove its tools from a broker that
    outlives it (no worker would listen on their queue)."""
    unfinished = [h for h in handles if not h.done()]
    for h in unfinished:
        h.cancel()
    deadline = time.monotonic() + LEAVE_WITHIN
    while any(not h.done() for h in unfinished) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sum(1 for h in unfinished if not h.done())
    if unfinished:
        console.print(f"cancelled {len(unfinished) - left} unfinished calls of the demo" + (
            f"; {left} did not end within {LEAVE_WITHIN:g} s" if left else ""))
    if gw.broker.embedded is None:
        for spec in DEMO_TOOLS:
            gw.directory.remove(spec["name"])
