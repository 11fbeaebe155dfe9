"""What the console's overview shows, read from Redis in one pass: one snapshot every tick of its stream.

Every figure is cumulative or current; the page turns consecutive snapshots into rates and percentiles.
``hermes:stats`` is read by ``workers.telemetry.read_stats``, as for ``status`` and ``/metrics``.
"""

from __future__ import annotations

import time
from typing import Any

from broker import keys, memory
from broker.breaker import OPEN, Breakers, breaker_config
from broker.limits import Limits
from workers.telemetry import LATENCY_BOUNDS, Stats, queue_depths, read_inflight, read_stats, text

LATE_AFTER = 2.0  # heartbeat intervals (plus a second of slack) after which a worker is shown late


def call_figures(stats: Stats) -> dict[str, Any]:
    """Calls by state (all tools), by tool and state, and the duration bucket counts of every tool."""
    states: dict[str, int] = {}
    by_tool: dict[str, dict[str, int]] = {}
    for (kind, name, state, _), n in stats.calls.items():
        states[state] = states.get(state, 0) + n
        row = by_tool.setdefault(f"{kind}:{name}", {})
        row[state] = row.get(state, 0) + n
    buckets = [sum(counts[i] for counts in stats.latency.values()) for i in range(len(LATENCY_BOUNDS) + 1)]
    latency = {"bounds": list(LATENCY_BOUNDS), "counts": buckets}
    return {"states": states, "by_tool": by_tool, "latency": latency}


def usage_figures(stats: Stats) -> list[dict[str, Any]]:
    """Per principal and tool or model: calls, and an LLM call's tokens in and out (``telemetry.Usage``)."""
    figures = [((p, f"{kind}:{name}"), "calls", n) for (p, kind, name), n in stats.pcalls.items()]
    figures += [((p, f"llm:{model}"), f"tokens_{way}", n) for (p, model, way), n in stats.tokens.items()]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for key, figure, n in figures:
        empty = {"principal": key[0], "name": key[1], "calls": 0, "tokens_in": 0, "tokens_out": 0}
        rows.setdefault(key, empty)[figure] += n
    return [rows[k] for k in sorted(rows)]


def rate_limits(conn: Any) -> list[dict[str, Any]]:
    """Every rate limiter: its limits, what is left in the window, calls waiting, a pause and its end."""
    from broker.ratelimits import RateLimiter

    return RateLimiter(conn).snapshot(Limits(conn).queues())


def workers(conn: Any, lease: float, now: float) -> list[dict[str, Any]]:
    """Every worker with a heartbeat on record (late ones too, until the reaper drops them), newest first."""
    names = [text(n) for n in conn.zrevrange(keys.WORKERS, 0, -1)]
    pipe = conn.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(keys.worker(n))
    out = []
    default_interval = max(0.2, min(lease / 3.0, 5.0))
    for name, raw in zip(names, pipe.execute(), strict=True):
        if not raw:
            continue
        w = {text(k): text(v) for k, v in raw.items()}
        interval = _float(w.get("heartbeat_interval"), default_interval)
        age = max(0.0, now - _float(w.get("heartbeat"), now))
        out.append(
            {
                "name": name,
                "host": w.get("host", ""),
                "pid": _int(w.get("pid")),
                "queues": [q for q in w.get("queues", "").split(",") if q],
                "inflight": _int(w.get("inflight")),
                "concurrency": _int(w.get("concurrency")),
                "processed": _int(w.get("processed")),
                "failed": _int(w.get("failed")),
                "version": w.get("version", ""),
                "heartbeat_age": round(age, 3),
                "heartbeat_interval": interval,
                "late": age > LATE_AFTER * interval + 1.0,
            }
        )
    return out


def breakers(conn: Any, cooldowns: dict[str, float]) -> list[dict[str, Any]]:
    """Every breaker that ever changed, with when an open one lets its next probe through."""
    out = []
    for view in Breakers(conn).all():
        cooldown = cooldowns.get(view["key"])
        if view["state"] == OPEN and cooldown is not None:
            view["next_probe_at"] = float(view.get("opened_at") or 0) + cooldown
        view["cooldown"] = cooldown
        out.append(view)
    return out


def breaker_cooldowns(settings: Any, entries: list[Any]) -> dict[str, float]:
    """Breaker key -> cooldown, from the specs in the directory (and executors.<type>.breaker)."""
    configs = (breaker_config(settings, entry.spec) for entry in entries)
    return {cfg.key: cfg.cooldown for cfg in configs if cfg is not None}


def slots(
    conn: Any, settings: Any, entries: list[Any], served: set[str] | None = None,
    running: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Per concurrency key: its limit, calls executing, slots held and calls waiting; every tool of the
    directory has a row, even while idle. ``served``: the queues some live worker listens on; a busy row
    of a tool whose queue is not among them names it in ``no_worker`` (the cause, not the limit)."""
    rows = {row["key"]: row for row in Limits(conn).snapshot()}
    queue_of: dict[str, str] = {}
    for entry in entries:
        spec = entry.spec
        key = f"tool:{spec.name}"
        queue_of[key] = str(spec.config.get("queue") or "tools")
        limit = spec.concurrency or settings.concurrency_for(spec.executor)
        rows.setdefault(key, {"key": key, "limit": limit, "running": 0, "waiting": 0})
    running = read_inflight(conn) if running is None else running  # (a caller that read it already)
    for ckey, n in running.items():
        rows.setdefault(ckey, {"key": ckey, "limit": -1, "running": n, "waiting": 0})
    for row in rows.values():
        row["executing"] = running.get(row["key"], 0)
        queue = queue_of.get(row["key"])
        busy = row["running"] > 0 or row["waiting"] > 0
        row["no_worker"] = queue if served is not None and queue and busy and queue not in served else None
        # The limit is what holds calls back: every slot taken and calls waiting for one (with workers).
        row["bottleneck"] = (
            not row["no_worker"] and row["limit"] >= 0 and row["running"] >= row["limit"] and row["waiting"] > 0
        )
    return sorted(rows.values(), key=lambda r: r["key"])


def batches(conn: Any, limit: int = 20, principal: str | None = None) -> list[dict[str, Any]]:
    """The newest batches on record (``principal``'s only, when given: the stats stream shows a principal
    only theirs) with their counts, rate and ETA (``hermes_gateway/batches.py``), and who made each."""
    from hermes_gateway.batches import BatchStore

    return [{**p.to_dict(), "principal": p.principal} for p in BatchStore(conn).recent(limit, principal)]


def snapshot(gw: Any) -> dict[str, Any]:
    """One tick of the overview: call figures, queues, slots per concurrency key, workers, breakers."""
    conn = gw.conn
    now = time.time()
    stats = read_stats(conn)
    calls = call_figures(stats)
    entries = gw.directory.all()
    live = workers(conn, gw.settings.workers.lease, now)
    served = {q for w in live if not w["late"] for q in w["queues"]}
    return {
        "ts": now,
        "calls": calls["states"],
        "by_tool": calls["by_tool"],
        "latency": calls["latency"],
        "queues": dict(queue_depths(conn)),
        "limits": slots(conn, gw.settings, entries, served),
        "rate_limits": rate_limits(conn),
        "usage": usage_figures(stats),
        "workers": live,
        "breakers": breakers(conn, breaker_cooldowns(gw.settings, entries)),
        "batches": batches(conn),
        "scheduled_retries": Limits(conn).scheduled(),  # (per queue: every queue has its own set)
        "memory": memory.usage(conn).to_dict(),  # with a warning past 80 % of maxmemory
        # Bumped on every directory change: the page reloads its tool list when it moves.
        "tools_version": int(conn.get(keys.TOOLS_VERSION) or 0),
    }


def _float(value: Any, default: float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _int(value: Any) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return 0
