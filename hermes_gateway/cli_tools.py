"""``hermes-gateway tool``: list, run, register, show and remove tools."""

from __future__ import annotations

import json

import click

from broker.errors import CallCancelled, CallFailed, CallTimeout, HermesError
from hermes_gateway.cli_common import (
    _event_line,
    _fail,
    _gateway,
    _note,
    _print_result,
    _settings,
    _sync_tools,
)

# -- tools ---------------------------------------------------------------------------------------


@click.group()
def tool() -> None:
    """List, run and register tools."""


@tool.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def tool_list(ctx: click.Context, as_json: bool) -> None:
    """List the tools in the directory (and in $HERMES_HOME/tools)."""
    from hermes_gateway.views import breaker_states, tool_rows, tools_table

    settings = _settings(ctx)
    with _gateway(settings, need_workers=False) as (gw, _):
        _sync_tools(gw)
        entries = gw.tools()
        states = breaker_states(gw.conn, [e.spec for e in entries], settings)
        if as_json:
            click.echo(json.dumps(tool_rows(entries, settings, states), ensure_ascii=False, indent=2))
        else:
            tools_table(entries, settings, states)


@tool.command("run")
@click.argument("name")
@click.argument("args", nargs=-1)
@click.option("--follow", "-f", is_flag=True, help="Also print each state transition with its trace id.")
@click.option("--timeout", type=float, default=None, help="Seconds to wait for the result.")
@click.option("--session-id", default=None)
@click.option("--principal", default=None)
@click.pass_context
def tool_run(ctx: click.Context, name: str, args: tuple[str, ...], follow: bool, timeout: float | None, session_id: str | None, principal: str | None) -> None:
    """Run one tool call: ARGS is JSON or YAML flow form, e.g. '{name: Alice}' (unquoted, as in
    `tool run hello {name: Alice}`, the shell's words are joined back with spaces)."""
    from workers.args import parse_args_text

    settings = _settings(ctx)
    try:
        parsed = parse_args_text(" ".join(args) or "{}")
    except HermesError as e:
        _fail(str(e))
    with _gateway(settings) as (gw, procs):
        if procs:
            _note(f"broker: {gw.description}; started {len(procs)} worker for this call")
        _sync_tools(gw)
        try:
            spec = gw.tool(name).spec
            if not procs:
                gw.require_workers(str(spec.config.get("queue") or "tools"))
            context = {k: v for k, v in (("session_id", session_id), ("principal", principal)) if v}
            handle = gw.call_tool(name, parsed, timeout=timeout, **context)
            if follow:
                for ev in handle.events(timeout=timeout):
                    _note(_event_line(ev))
            result = handle.result(timeout)
        except CallCancelled as e:
            _fail(f"cancelled: {e}", 1)
        except CallTimeout as e:
            _fail(str(e), 1)
        except CallFailed as e:
            _fail(f"{e.error_type}: {e}", 1)
        except HermesError as e:
            _fail(f"{e.type}: {e}")
        _print_result(result)



@tool.command("register")
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False))
@click.pass_context
def tool_register(ctx: click.Context, spec_file: str) -> None:
    """Add or update a tool from a YAML spec file."""
    from pathlib import Path

    from broker.directory import load_spec_file

    with _gateway(_settings(ctx), need_workers=False) as (gw, _):
        try:
            spec = load_spec_file(Path(spec_file))
        except HermesError as e:
            _fail(str(e))
        version, changed = gw.directory.register(spec)
        click.echo(f"{spec.name}: {'registered' if changed else 'unchanged'} (version {version})")


@tool.command("show")
@click.argument("name")
@click.pass_context
def tool_show(ctx: click.Context, name: str) -> None:
    """Print one tool's spec."""
    import yaml

    with _gateway(_settings(ctx), need_workers=False) as (gw, _):
        _sync_tools(gw)
        try:
            entry = gw.tool(name)
        except HermesError as e:
            _fail(str(e))
        click.echo(yaml.safe_dump({**entry.spec.to_dict(), "version": entry.version}, allow_unicode=True, sort_keys=False))


@tool.command("remove")
@click.argument("name")
@click.pass_context
def tool_remove(ctx: click.Context, name: str) -> None:
    """Remove a tool from the directory."""
    with _gateway(_settings(ctx), need_workers=False) as (gw, _):
        if not gw.directory.remove(name):
            _fail(f"unknown tool {name!r}")
        click.echo(f"{name}: removed")

