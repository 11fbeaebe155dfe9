"""``hermes-gateway audit``: list, show, replay and export the audit log of finished calls."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import click
import yaml

from broker.audit import AuditLog, AuditRecord
from broker.errors import HermesError
from hermes_gateway.cli.common import WAIT_SECONDS, event_line, fail, note, settings_of, shared_broker

STATES = ("done", "failed", "cancelled")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


LATEST = 253402300799.0  # 9999-12-31T23:59:59Z, in unix seconds


def parse_when(text: str, now: float | None = None) -> float:
    """``15m``/``2h``/``7d`` ago, an ISO date or time (local unless it names a zone), or unix seconds."""
    now = time.time() if now is None else now
    m = _DURATION.match(text)
    when: float | None = None
    if m:
        when = now - float(m.group(1)) * _UNIT[m.group(2)]
    else:
        with contextlib.suppress(ValueError):
            when = float(text)
    if when is None:
        try:
            when = datetime.fromisoformat(text.strip()).timestamp()
        except (ValueError, OverflowError):
            raise click.BadParameter(
                f"{text!r}: expected a duration (90s, 15m, 2h, 7d), an ISO time (2025-01-31T08:00) or unix seconds"
            ) from None
    if not 0 <= when <= LATEST:  # (NaN fails this too)
        raise click.BadParameter(f"{text!r}: out of range (a time from 1970 to the year 9999)")
    return when


class When(click.ParamType):
    """A point in time for ``--since``/``--until``."""

    name = "when"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        return value if isinstance(value, float) else parse_when(str(value))


@contextlib.contextmanager
def _log(ctx: click.Context) -> Iterator[tuple[Any, AuditLog]]:
    """A connection to the shared broker and its audit log (an embedded broker would have none)."""
    settings = settings_of(ctx)
    with shared_broker(settings, "the audit log") as handle:
        yield handle, AuditLog.from_settings(handle.conn, settings.audit)


def _stamp(ts: float) -> str:
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="milliseconds")


def _line(rec: AuditRecord) -> str:
    err = f"  {rec.error_type}" if rec.error_type else ""
    status = "-" if rec.status_code is None else str(rec.status_code)
    return (
        f"{_stamp(rec.ts)}  {rec.state:<9} {rec.kind:<4} {rec.name:<24} {rec.principal or '-':<16} "
        f"{rec.duration_ms:>9.1f} ms  {status:>5}  {rec.call_id}{err}"
    )


@click.group()
def audit() -> None:
    """The audit log: one record per finished call (tool and LLM), secrets redacted."""


@audit.command("list")
@click.option("--tool", default=None, help="Tool name (or model, for LLM calls).")
@click.option("--principal", default=None)
@click.option("--state", type=click.Choice(STATES), default=None, help="Final state.")
@click.option("--since", type=When(), default=None, help="15m, 2h, 7d, an ISO time, or unix seconds.")
@click.option("--limit", "-n", default=50, show_default=True, type=click.IntRange(min=1), help="Newest records to show.")
@click.option("--json", "as_json", is_flag=True, help="JSON lines instead of a table.")
@click.pass_context
def audit_list(
    ctx: click.Context, tool: str | None, principal: str | None, state: str | None, since: float | None,
    limit: int, as_json: bool,
) -> None:
    """Finished calls, newest first."""
    with _log(ctx) as (_, log):
        records = log.list(tool=tool, principal=principal, state=state, since=since, limit=limit)
    for rec in records:
        click.echo(rec.to_json() if as_json else _line(rec))
    if not records and not as_json:
        note("no audit records match")


@audit.command("show")
@click.argument("call_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: record, events, parent.")
@click.pass_context
def audit_show(ctx: click.Context, call_id: str, as_json: bool) -> None:
    """A call's audit record, its events (an ended call keeps its terminal event), and the LLM call that asked for it."""
    from broker import events as ev_mod

    with _log(ctx) as (handle, log):
        rec = log.get(call_id)
        history = ev_mod.history(handle.conn, call_id)
        parent = log.get(rec.parent_call_id) if rec is not None and rec.parent_call_id else None
    if rec is None and not history:
        fail(f"no audit record and no events for call {call_id} (unknown, or past retention)", 1)
    if as_json:
        out = {
            "record": rec.to_dict() if rec else None,
            "events": [e.to_dict() for e in history],
            "parent": parent.to_dict() if parent else None,
        }
        click.echo(json.dumps(out, ensure_ascii=False, indent=2, default=str))
        return
    if rec is None:
        click.echo(f"no audit record for {call_id} yet (the call has not finished, or it was trimmed)")
    else:
        click.echo(f"audit record of {call_id} (finished {_stamp(rec.ts)}):")
        click.echo(yaml.safe_dump(rec.to_dict(), allow_unicode=True, sort_keys=False, width=100).rstrip())
    click.echo("")
    if history:
        click.echo(f"events ({len(history)}):")
        for ev in history:
            click.echo("  " + event_line(ev))
    else:
        click.echo("events: none kept (the history expires with the call record)")
    if rec is not None and rec.parent_call_id:
        click.echo("")
        if parent is None:
            click.echo(f"asked for by LLM call {rec.parent_call_id} (no audit record for it)")
        else:
            click.echo(f"asked for by LLM call {rec.parent_call_id}:")
            click.echo("  " + _line(parent))
            if parent.model_params:
                params = json.dumps(parent.model_params, ensure_ascii=False, default=str)
                click.echo(f"  model_params: {params}")


@audit.command("replay")
@click.argument("call_id")
@click.option(
    "--arg", "arg_pairs", multiple=True, metavar="NAME=VALUE",
    help="A redacted argument (sensitive ones are checked against their recorded keyed hash).",
)
@click.option(
    "--timeout", type=WAIT_SECONDS, default=60.0, show_default=True, help="Seconds to wait for the replay."
)
@click.pass_context
def audit_replay(ctx: click.Context, call_id: str, arg_pairs: tuple[str, ...], timeout: float) -> None:
    """Run a finished tool call again with its recorded arguments; show both outcomes side by side."""
    from hermes_gateway import replay
    from hermes_gateway.client import Gateway

    supplied: dict[str, str] = {}
    for pair in arg_pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            fail(f"--arg {pair!r}: expected NAME=VALUE")
        supplied[name.strip()] = value
    with _log(ctx) as (handle, log), contextlib.closing(Gateway(handle, settings_of(ctx))) as gw:
        rec = log.get(call_id)
        if rec is None:
            fail(f"no audit record for call {call_id} (unknown, unfinished, or past retention)", 1)
        try:
            plan = replay.plan(rec, supplied, log.digest)
            gw.require_workers(str(gw.tool(plan.tool).spec.config.get("queue") or "tools"))
            outcome = replay.run(gw, log, plan, timeout)
        except HermesError as e:
            fail(f"{e.type}: {e}")
        click.echo(replay.render(outcome))


@audit.command("export")
@click.option("--since", type=When(), default=None, help="15m, 2h, 7d, an ISO time, or unix seconds.")
@click.option("--until", type=When(), default=None)
@click.option("--tool", default=None)
@click.option("--principal", default=None)
@click.option("--state", type=click.Choice(STATES), default=None)
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help="Default: stdout.")
@click.pass_context
def audit_export(
    ctx: click.Context, since: float | None, until: float | None, tool: str | None, principal: str | None,
    state: str | None, output: str | None,
) -> None:
    """Every matching record as JSON lines, oldest first (audit export --since 7d > audit.jsonl)."""
    with _log(ctx) as (_, log), contextlib.ExitStack() as stack:
        fp = stack.enter_context(open(output, "w", encoding="utf-8")) if output else sys.stdout
        n = log.export(fp, tool=tool, principal=principal, state=state, since=since, until=until)
        fp.flush()
    note(f"exported {n} record(s)" + (f" to {output}" if output else ""))
