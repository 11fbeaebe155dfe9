"""Terminal views: the tool list and the status page."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from broker import keys, memory
from broker.codec import unpack
from broker.config import Settings
from broker.directory import Entry
from broker.toolspec import ToolSpec

# Piped output (scripts, CI logs) gets wide tables instead of rich's 80-column default, so names stay whole.
# No markup: a description or an error message holding "[/red]" is shown as written, not read (or refused).
console = Console(width=None if sys.stdout.isatty() else 200, markup=False)


def breaker_states(conn: Any, specs: list[ToolSpec], settings: Settings) -> dict[str, str]:
    """Each tool's breaker state from ``hermes:breaker:<key>`` (``closed`` when none is stored; ``off`` for a
    tool with no breaker configured, which ``tool breaker`` says has none)."""
    from broker.breaker import breaker_config

    configs = {s.name: breaker_config(settings, s) for s in specs}
    names = {name: cfg.key for name, cfg in configs.items() if cfg is not None}
    pipe = conn.pipeline(transaction=False)
    for key in names.values():
        pipe.hget(keys.breaker(key), "state")
    states = dict(zip(names, pipe.execute(), strict=True))
    return {name: (states[name] or b"closed").decode() if name in names else "off" for name in configs}


def tool_rows(
    entries: list[Entry], settings: Settings, states: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """What ``tool list`` shows per tool: the spec, its version, effective limits and breaker state."""
    rows = []
    for e in entries:
        s = e.spec
        limits = {
            "concurrency": s.concurrency or settings.concurrency_for(s.executor),
            "queue_size": s.queue_size if s.queue_size is not None else settings.queue_size_for(s.executor),
            "timeout": s.timeout,
        }
        state = (states or {}).get(s.name, "closed")
        rows.append({**s.to_dict(), "version": e.version, "limits": limits, "breaker_state": state})
    return rows


def _table(title: str, *columns: str, right: tuple[str, ...] = ()) -> Table:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="right" if col in right else "left")
    return table


def _clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def tools_table(entries: list[Entry], settings: Settings, states: dict[str, str] | None = None) -> None:
    cols = ("name", "executor", "permissions", "concurrency", "queue_size", "timeout", "breaker", "version")
    table = _table("tools", *cols, "description")
    for row in tool_rows(entries, settings, states):
        perms = row.get("permissions")
        limits = row["limits"]
        table.add_row(
            row["name"],
            row["executor"],
            ",".join(perms) if perms is not None else "-",
            str(limits["concurrency"]),
            str(limits["queue_size"]),
            f"{limits['timeout']:g}s",
            row["breaker_state"],
            str(row["version"]),
            row["description"],
        )
    console.print(table)


def status_data(gw: Any, figures: bool = False, viewer: Any = None) -> dict[str, Any]:
    """Everything ``status`` shows, as data; ``figures``: with the live call figures. ``viewer``: a
    ``Caller`` that is not admin, shown its own principal's failures only and no breaker's probe call."""
    from workers.telemetry import queue_depths

    conn = gw.conn
    depths = queue_depths(conn)
    flow = flow_control_data(conn)
    # (every key with calls waiting has its limit recorded: the sweep drops a limit only once nothing waits)
    waiting = {row["key"]: row["waiting"] for row in flow["concurrency"] if row["waiting"]}
    failures: list[Any] = []
    for raw in conn.lrange(keys.FAILURES, 0, 9 if viewer is None else -1):
        try:
            entry = unpack(raw)
        except Exception:  # noqa: BLE001 - a damaged entry is skipped, not fatal
            continue
        if viewer is None or (isinstance(entry, dict) and viewer.sees(entry.get("principal"))):
            failures.append(entry)
        if len(failures) == 10:
            break
    data = {
        "broker": gw.description,
        "queues": [{"queue": queue, "depth": depth} for queue, depth in depths],
        "waiting_by_key": waiting,
        "leased_calls": sum(conn.zcard(keys.leases(keys.tag(queue))) for queue, _ in depths),
        "workers": gw.live_workers(),
        "recent_failures": failures,
        "memory": memory.usage(conn).to_dict(),  # with a warning past 80 % of maxmemory
        **flow,
    }
    if viewer is not None:  # (a probe's call id and another principal's usage are not this caller's to see)
        data["breakers"] = hide_probes(data["breakers"])
        data["usage"] = [u for u in data.get("usage") or [] if viewer.sees(u.get("principal"))]
    if figures:
        from hermes_gateway.watch import figures_json

        data["figures"] = figures_json(conn)  # what `status --watch` shows: calls by tool/state/error, ...
    return data


def hide_probes(breakers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Breakers without the id of a half-open one's probe call (another principal's, maybe)."""
    return [{**b, "probe": None} if b.get("probe") else b for b in breakers]


def flow_control_data(conn: Any) -> dict[str, Any]:
    """Concurrency keys (limit, running, waiting), retries on the schedule, circuit breakers."""
    from broker.breaker import Breakers
    from broker.limits import Limits
    from hermes_gateway.console_data import rate_limits, usage_figures
    from workers.telemetry import read_stats

    return {
        "concurrency": Limits(conn).snapshot(),
        "scheduled_retries": Limits(conn).scheduled(),
        "breakers": Breakers(conn).all(),
        "rate_limits": rate_limits(conn),
        "usage": usage_figures(read_stats(conn)),
    }


def print_flow_control(data: dict[str, Any]) -> None:
    title = f"concurrency keys (retries scheduled: {data['scheduled_retries']})"
    c = _table(title, "key", "limit", "running", "waiting", right=("limit", "running", "waiting"))
    for row in data["concurrency"]:
        limit = "-" if row["limit"] < 0 else str(row["limit"])
        c.add_row(row["key"], limit, str(row["running"]), str(row["waiting"]))
    console.print(c)
    if data.get("rate_limits"):
        cols = ("requests/min", "tokens/min", "requests/s", "waiting", "paused until")
        r = _table("rate limits (left in the window / limit)", "key", *cols, right=cols)
        for row in data["rate_limits"]:
            left, limits = row["left"], row["limits"]
            cells = [
                f"{left[k]}/{limits[k]}" if k in limits else "-"
                for k in ("requests_per_minute", "tokens_per_minute", "requests_per_second")
            ]
            r.add_row(row["key"], *cells, str(row["waiting"]), _clock(row.get("paused_until")))
        console.print(r)
    if data.get("usage"):
        counts = ("calls", "tokens in", "tokens out")
        u = _table("usage per principal", "principal", "tool / model", *counts, right=counts)
        for row in data["usage"]:
            u.add_row(row["principal"], row["name"], str(row["calls"]), str(row["tokens_in"]), str(row["tokens_out"]))
        console.print(u)
    b = _table("circuit breakers", "key", "state", "since", "reason", "last error")
    for row in data["breakers"]:
        reason, error = row.get("reason") or "", row.get("last_error") or ""
        b.add_row(row["key"], row["state"], _clock(row.get("changed_at")), reason, error)
    console.print(b)


def print_status(data: dict[str, Any], description: str) -> None:
    console.print(f"broker: {description}")
    mem = data.get("memory") or {}
    if mem.get("warning"):
        console.print(f"warning: {mem['warning']}", style="bold red", highlight=False)
    elif mem.get("maxmemory"):
        console.print(f"memory: {memory.mib(mem['used'])} of {memory.mib(mem['maxmemory'])} (maxmemory)")
    q = _table("queues", "queue", "depth", right=("depth",))
    for row in data["queues"]:
        q.add_row(row["queue"], str(row["depth"]))
    console.print(q)
    cols = ("name", "queues", "in flight", "concurrency", "processed", "failed", "heartbeat")
    w = _table(f"workers ({len(data['workers'])})", *cols)
    now = time.time()
    for row in data["workers"]:
        w.add_row(
            row.get("name", ""),
            row.get("queues", ""),
            row.get("inflight", "0"),
            row.get("concurrency", ""),
            row.get("processed", "0"),
            row.get("failed", "0"),
            f"{now - float(row.get('heartbeat', now)):.1f}s ago",
        )
    console.print(w)
    print_flow_control(data)
    f = _table("recent failures", "when", "call", "name", "error")
    for row in data["recent_failures"]:
        err = row.get("error") or {}
        f.add_row(
            time.strftime("%H:%M:%S", time.localtime(row.get("ts", 0))),
            str(row.get("call_id", ""))[:12],
            str(row.get("name", "")),
            f"{err.get('type')}: {err.get('message')}",
        )
    console.print(f)


VIEW_MAX_TEXT = 256 * 1024  # a longer string in a request view is shown in part (saying how much more)


def call_request(conn: Any, call_id: str, audit: Any = None) -> dict[str, Any] | None:
    """What a call asked for, secrets masked: a tool call's args (``sensitive`` ones as their hash), an LLM
    call's whole request, tool results fed back included. None: no such call. An ended call keeps only its
    outcome: then its audit record answers (``audit``; ``"source": "audit"``, without an LLM call's
    messages), else the answer says the request is gone."""
    from broker.calls import read_record
    from broker.directory import Directory
    from broker.errors import HermesError
    from broker.logs import redact

    rec = read_record(conn, call_id)
    if rec is None:
        return None
    env = rec.get("envelope")
    out: dict[str, Any] = {"call_id": call_id, "kind": rec["kind"], "name": rec["name"], "state": rec["state"]}
    if rec.get("request_dropped"):
        return _ended_request(out, audit.get(call_id) if audit is not None else None)
    if env is None:
        out["error"] = "the call's payload could not be decoded"
        return out
    out["context"] = redact(dict(env.context))
    if env.kind == "llm":
        out["request"] = redact(env.request, max_text=VIEW_MAX_TEXT)
        return out
    args = dict(env.args or {})
    try:
        entry = Directory(conn).get(env.tool or "")
        # The spec the call ran under says which args are sensitive; once it changed, nobody can tell.
        sensitive = entry.spec.sensitive if entry.version == env.tool_version else tuple(args)
    except HermesError:
        sensitive = tuple(args)  # the tool was removed since: every arg as its hash
    out["args"] = redact(args, sensitive, max_text=VIEW_MAX_TEXT)
    return out


ENDED_REQUEST = "the call has ended: its request is no longer kept (an ended call keeps only its outcome)"


def _ended_request(out: dict[str, Any], audited: Any) -> dict[str, Any]:
    """``call_request`` of an ended call: what its audit record kept, or why there is nothing."""
    from broker.audit import CONTEXT_KEYS

    if audited is None:
        out["error"] = f"{ENDED_REQUEST}, and no audit record of it was found"
        return out
    out["source"] = "audit"
    out["note"] = f"{ENDED_REQUEST}: shown from its audit record"
    out["context"] = {k: getattr(audited, k) for k in CONTEXT_KEYS if getattr(audited, k) is not None}
    if out["kind"] == "llm":
        out["request"] = {"model": audited.model, **audited.model_params}  # (the messages are not audited)
    else:
        out["args"] = audited.args
    return out
