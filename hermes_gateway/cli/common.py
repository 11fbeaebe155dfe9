"""Helpers shared by the ``hermes-gateway`` command modules (``hermes_gateway/cli/*_cmd.py``)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import click

from broker.config import Settings
from broker.errors import HermesError, InvalidSpec


def settings_of(ctx: click.Context) -> Settings:
    """The settings the root group loaded (``--home``, config.yaml, the environment)."""
    return ctx.find_root().obj["settings"]


def print_result(result: Any) -> None:
    """A call's result on stdout: text as it is, anything else as indented JSON."""
    if isinstance(result, str):
        click.echo(result)
    else:
        click.echo(json.dumps(result, ensure_ascii=False, indent=2, default=str))


def note(message: str, level: str = "info") -> None:
    """A notice for the user on stderr: plain text, or in JSON mode a JSON line shaped like the log lines
    (so `2>&1 | jq` works). It is the command's own output, so the log level never hides it."""
    from broker.logs import json_lines, redact_text

    if json_lines():
        from datetime import UTC, datetime

        stamp = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        line = {"event": redact_text(message), "level": level, "logger": "hermes.cli", "timestamp": stamp}
        click.echo(json.dumps(line, ensure_ascii=False), err=True)
    else:
        click.echo(message if level == "info" else f"{level}: {message}", err=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """``note`` the error and exit with ``code`` (2: usage or configuration, 1: the operation failed)."""
    note(message, "error")
    sys.exit(code)


@contextlib.contextmanager
def failing(code: int = 2, *, typed: bool = False) -> Iterator[None]:
    """A HermesError in the block ``fail``s the command with exit ``code``; ``typed`` puts its type first."""
    try:
        yield
    except HermesError as e:
        fail(f"{e.type}: {e}" if typed else str(e), code)


def sync_tools(gw: Any, *, write: bool = True) -> list[str]:
    """Register ``$HERMES_HOME/tools``; a spec file that does not load is named on stderr and skipped. A command
    that only reads (``write=False``) on a broker that refuses it the write (a read-only ACL user) reads the
    directory as it is and names the local specs it lacks (returned), instead of failing."""
    import redis

    errors: list[InvalidSpec] = []
    lacking: list[str] = []
    try:
        gw.sync_tools(errors=errors)
    except redis.exceptions.NoPermissionError:
        if write:
            raise
        from workers.specs import load_spec_dir

        errors = []
        held = {e.spec.name: e.spec.digest() for e in gw.tools()}
        lacking = [s.name for s in load_spec_dir(gw.settings.tools_dir, errors) if held.get(s.name) != s.digest()]
        if lacking:
            note(f"{', '.join(lacking)}: $HERMES_HOME/tools holds specs this broker user may not register (a user "
                 "that may, or `tool register FILE` as one, registers them)")
    for e in errors:
        note(f"skipped {e}", "warning")
        if e.__cause__ is not None:  # the parser's own account, several lines: with --log-level debug
            import structlog

            structlog.get_logger("hermes.cli").debug("spec file problem in full", detail=str(e.__cause__))
    return lacking


def event_line(ev: Any) -> str:
    """One line of ``events``: the state or event type, trace id, attempt and what the event carries."""
    label = ev.state if ev.type == "transition" else ev.type
    extra = ""
    if ev.type != "transition":
        extra = " " + json.dumps(ev.detail, ensure_ascii=False, default=str)
    elif "error" in ev.detail:
        extra = f" {ev.detail['error'].get('type')}: {ev.detail['error'].get('message')}"
    elif "duration_ms" in ev.detail:
        extra = f" ({ev.detail['duration_ms']:.1f} ms)"
    return f"[{ev.seq:>2}] {label:<10} trace_id={ev.trace_id} attempt={ev.attempt}{extra}"


def outcome_line(status: str, name: str, version: int | None, source: str, reason: str) -> str:
    """One line of ``migrate`` or ``mcp add``: what became of one tool spec, and why."""
    ver = f"v{version}" if version is not None else "-"
    return f"{status:<10} {name:<28} {ver:<6} {source}" + (f"  ({reason})" if reason else "")


@contextlib.contextmanager
def open_gateway(settings: Settings, need_workers: bool = True) -> Iterator[tuple[Any, list[Any]]]:
    """The gateway for one command; broker errors become a clear message and exit code 2."""
    from hermes_gateway.local import local_stack

    with contextlib.ExitStack() as stack:
        with failing():
            pair = stack.enter_context(local_stack(settings, need_workers=need_workers))
        yield pair


@contextlib.contextmanager
def shared_broker(settings: Settings, what: str = "") -> Iterator[Any]:
    """The shared broker (``connect_shared``), closed after the block. Unreachable: exit 2, the message
    saying that ``what`` lives in the broker when given."""
    from hermes_gateway.local import connect_shared

    try:
        handle = connect_shared(settings)
    except HermesError as e:
        fail(f"{e} ({what} lives in the broker: set HERMES_REDIS_URL)" if what else str(e))
    with contextlib.closing(handle):
        yield handle


# Option types shared by the commands: a bad value is click's usage error (exit 2), never a traceback.
POSITIVE = click.IntRange(min=1)
SECONDS = click.FloatRange(min=0)
WAIT_SECONDS = click.FloatRange(min=0, min_open=True)  # how long to wait for a result: more than 0


def check_queues(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """``--queues``: at least one name (an empty list would start a worker that never takes a call)."""
    if not [q for q in value.split(",") if q.strip()]:
        raise click.BadParameter("name at least one queue, e.g. tools,llm")
    return value


def read_args_text(value: str) -> str:
    """Arguments given on the command line: ``-`` reads them from stdin, ``@PATH`` from a file (for
    arguments too long for a command line), anything else is the text itself."""
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read arguments from {value[1:]}: {e}")
    return value
