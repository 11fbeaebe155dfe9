"""``hermes-gateway status --watch``: the call figures of the OpenTelemetry metrics, live in the terminal,
read from the totals workers add to ``hermes:stats`` (so it works with metrics export off)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from broker import keys
from workers.telemetry import Timing, queue_depths, read_inflight, read_stats, text


def call_known(conn: redis.Redis, call_id: str) -> bool:
    """The call has a record or an event history here (what ``events CALL_ID`` checks first)."""
    return bool(conn.exists(keys.job(call_id), keys.history(call_id), keys.ended(call_id)))


def figures(conn: redis.Redis) -> dict[str, Any]:
    """Everything the live view shows, as plain data (a few round trips)."""
    stats = read_stats(conn)
    calls: dict[str, dict[str, Any]] = {}
    for kind, name in stats.names:
        timing = stats.durations.get((kind, name), Timing())
        calls[f"{kind}:{name}"] = {"states": {}, "duration_s": timing.seconds, "n": timing.n}
    errors: dict[tuple[str, str], int] = {}
    for (kind, name, state, etype), n in stats.calls.items():
        label = f"{kind}:{name}"
        states = calls[label]["states"]
        states[state] = states.get(state, 0) + n
        if etype:
            errors[(label, etype)] = errors.get((label, etype), 0) + n
    breaker_keys = sorted(text(k) for k in conn.smembers(keys.BREAKERS))
    pipe = conn.pipeline(transaction=False)
    for k in breaker_keys:
        pipe.hget(keys.breaker(k), "state")
    breakers = {k: (s or b"closed").decode() for k, s in zip(breaker_keys, pipe.execute(), strict=True)}
    for key, state in stats.breakers.items():  # reported through workers.telemetry.breaker_changed
        breakers.setdefault(key, state)
    return {
        "calls": calls,
        "errors": errors,
        "queue_wait": {q: w.mean for q, w in stats.waits.items()},
        "inflight": read_inflight(conn),
        "breakers": breakers,
        "queues": dict(queue_depths(conn)),
        "ts": time.time(),
    }


def figures_json(conn: redis.Redis) -> dict[str, Any]:
    """``figures`` as JSON-safe data: errors become ``[{"call", "error_type", "count"}]``."""
    data = figures(conn)
    data["errors"] = [
        {"call": name, "error_type": etype, "count": n} for (name, etype), n in sorted(data["errors"].items())
    ]
    return data


def _print_line(line: str) -> None:
    print(line, flush=True)  # a reader on a pipe (jq) gets each refresh as it comes


def watch_json(
    conn: redis.Redis, interval: float = 1.0, rounds: int | None = None, out: Callable[[str], None] = _print_line
) -> None:
    """One JSON line of ``figures_json`` now and every ``interval`` seconds (``status --watch --json``)."""
    done = 0
    try:
        while True:
            out(json.dumps(figures_json(conn), default=str))
            if rounds is not None and done >= rounds:
                return
            time.sleep(interval)
            done += 1
    except (KeyboardInterrupt, BrokenPipeError):  # Ctrl-C, or the reader (head, jq) went away
        pass


def _total(row: dict[str, Any]) -> int:
    return sum(row["states"].values())


def _table(title: str, *columns: str, numbers: bool = False) -> Table:
    """A table of ``columns``; with ``numbers``, all but the first right-aligned."""
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="right" if numbers and i else "left")
    return table


def render(data: dict[str, Any], previous: dict[str, Any] | None = None) -> Group:
    """The tables for one refresh; rates come from the difference with ``previous``."""
    elapsed = max(1e-6, data["ts"] - previous["ts"]) if previous else 0.0
    calls = _table("calls", "name", "done", "failed", "cancelled", "other", "mean ms", "per s", numbers=True)
    for name, row in sorted(data["calls"].items()):
        states = dict(row["states"])
        done, failed, cancelled = (states.pop(s, 0) for s in ("done", "failed", "cancelled"))
        mean = row["duration_s"] / row["n"] * 1000 if row["n"] else 0.0
        rate = ""
        if previous:
            before = previous["calls"].get(name)
            rate = f"{(_total(row) - (_total(before) if before else 0)) / elapsed:,.1f}"
        calls.add_row(
            name, str(done), str(failed), str(cancelled), str(sum(states.values())), f"{mean:,.1f}", rate
        )
    errors = _table("errors", "name", "error type", "count")
    for (name, etype), n in sorted(data["errors"].items()):
        errors.add_row(name, etype, str(n))
    queues = _table("queues", "queue", "depth", "mean wait ms")
    for q in sorted(set(data["queues"]) | set(data["queue_wait"])):
        queues.add_row(q, str(data["queues"].get(q, 0)), f"{data['queue_wait'].get(q, 0.0) * 1000:,.1f}")
    flight = _table("in flight", "concurrency key", "calls", numbers=True)
    for k, n in sorted(data["inflight"].items()):
        flight.add_row(k, str(n))
    breakers = _table("breakers", "key", "state")
    for k, s in sorted(data["breakers"].items()):
        breakers.add_row(k, f"[red]{s}[/red]" if s == "open" else s)
    return Group(calls, errors, queues, flight, breakers)


def watch(
    conn: redis.Redis, interval: float = 1.0, rounds: int | None = None, console: Console | None = None
) -> None:
    """Redraw the figures every ``interval`` seconds until Ctrl-C (or ``rounds`` refreshes)."""
    previous = figures(conn)
    done = 0
    with Live(render(previous), console=console, refresh_per_second=4, transient=False) as live:
        try:
            while rounds is None or done < rounds:
                time.sleep(interval)
                current = figures(conn)
                live.update(render(current, previous))
                previous, done = current, done + 1
        except KeyboardInterrupt:
            pass
