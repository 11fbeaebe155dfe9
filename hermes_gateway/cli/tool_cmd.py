"""``hermes-gateway tool``: list, run, register, show and remove tools."""

from __future__ import annotations

import json
from typing import Any

import click
from redis import RedisError

from broker.errors import CallCancelled, CallFailed, CallTimeout, HermesError
from hermes_gateway.cli.common import (
    WAIT_SECONDS,
    event_line,
    fail,
    failing,
    note,
    open_gateway,
    print_result,
    read_args_text,
    settings_of,
    sync_tools,
)
from hermes_gateway.handle import interrupt_after


@click.group()
def tool() -> None:
    """List, run and register tools."""


@tool.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def tool_list(ctx: click.Context, as_json: bool) -> None:
    """List the tools in the directory (and in $HERMES_HOME/tools)."""
    from hermes_gateway.views import breaker_states, tool_rows, tools_table

    settings = settings_of(ctx)
    with open_gateway(settings, need_workers=False) as (gw, _):
        lacking = sync_tools(gw, write=False)
        entries = gw.tools()
        states = breaker_states(gw.conn, [e.spec for e in entries], settings)
        if as_json:
            click.echo(json.dumps(tool_rows(entries, settings, states), ensure_ascii=False, indent=2))
        else:
            tools_table(entries, settings, states)
    if entries or lacking:
        return
    from hermes_gateway.migrate import _Unreadable, find_legacy

    old = next((f for f in find_legacy(settings.home) if not isinstance(f.raw, _Unreadable)), None)  # (broken: warned)
    if old is not None:  # the seed's pitfall 7: an upgrade from v0.9 leaves the list empty until migrated
        note(f"no tools registered, but {settings.home / old.source.split('[')[0]} holds v0.9 tool specs: "
             "run `hermes-gateway migrate` to import them")


@tool.command("run")
@click.argument("name")
@click.argument("args", nargs=-1)
@click.option("--follow", "-f", is_flag=True, help="Also print each state transition with its trace id.")
@click.option(
    "--timeout", type=WAIT_SECONDS, default=None,
    help="The call's timeout in seconds, in place of its spec's: the call is stopped then (Ctrl-C cancels it too).",
)
@click.option("--session-id", default=None)
@click.option("--principal", default=None)
@click.pass_context
def tool_run(
    ctx: click.Context, name: str, args: tuple[str, ...], follow: bool, timeout: float | None,
    session_id: str | None, principal: str | None,
) -> None:
    """Run one tool call: ARGS is JSON or YAML flow form, e.g. '{name: Alice}' (unquoted, as in
    `tool run hello {name: Alice}`, the shell's words are joined back with spaces; a value the tool's
    schema wants as text stays as typed, `{zip: 02134}`); @FILE reads them from a file, - from stdin."""
    from workers.args import parse_args_text

    settings = settings_of(ctx)
    text = read_args_text(args[0]) if len(args) == 1 else " ".join(args)
    with failing():
        parsed = parse_args_text(text or "{}")
    with open_gateway(settings) as (gw, procs):
        if procs and gw.broker.embedded is not None:  # (on a gateway's broker, local_stack said so)
            note(f"broker: {gw.description}; started {len(procs)} worker for this call")
        sync_tools(gw)
        try:
            spec = gw.tool(name).spec
            with failing():  # (again, with the schema: what it wants as text stays the text typed)
                parsed = parse_args_text(text or "{}", spec.input_schema)
            if not procs:
                gw.require_workers(str(spec.config.get("queue") or "tools"))
            context = {k: v for k, v in (("session_id", session_id), ("principal", principal)) if v}
            handle = None
            try:
                with interrupt_after():  # (a Ctrl-C while the call is being sent comes once it has its handle)
                    handle = gw.call_tool(name, parsed, timeout=timeout, **context)
                if follow:  # (no wait of our own: the worker ends the call at its --timeout, as a tool_timeout)
                    for ev in handle.events():
                        note(event_line(ev))
                result = handle.result()
            except KeyboardInterrupt:  # Ctrl-C: the call is this command's, so it stops too (as --timeout's)
                if handle is None:
                    fail("interrupted: the call was not sent", 130)
                try:
                    cancelled = handle.cancel()
                except (HermesError, RedisError) as e:
                    fail(f"interrupted: call {handle.call_id} may still run: cancelling it failed: {e}", 130)
                fail(f"interrupted: call {handle.call_id} " + ("cancelled" if cancelled else "had already ended"), 130)
        except CallCancelled as e:
            fail(f"cancelled: {e}", 1)
        except CallTimeout as e:
            fail(str(e), 1)
        except CallFailed as e:
            fail(f"{e.error_type}: {e}", 1)
        except HermesError as e:
            fail(f"{e.type}: {e}")
        print_result(result)


@tool.command("register")
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--force", is_flag=True,
    help="On a broker of this command only: overwrite a different spec file of that name in $HERMES_HOME/tools.",
)
@click.pass_context
def tool_register(ctx: click.Context, spec_file: str, force: bool) -> None:
    """Add or update a tool from a YAML spec file.

    Without HERMES_REDIS_URL it goes to the broker of the `serve` or `worker` of this $HERMES_HOME running
    here; when none runs, the command's broker ends with it, so the spec is written to $HERMES_HOME/tools
    (which every command loads) instead of being lost."""
    from pathlib import Path

    from hermes_gateway.local import THROWAWAY_NOTE, throwaway
    from workers.specs import load_spec_file

    settings = settings_of(ctx)
    source = Path(spec_file)
    with failing():
        spec = load_spec_file(source)
    with open_gateway(settings, need_workers=False) as (gw, _):
        kept = None
        if throwaway(gw):
            kept = _keep_spec_file(settings.tools_dir, source, spec, force)
        version, changed = gw.directory.register(spec)
        click.echo(f"{spec.name}: {'registered' if changed else 'unchanged'} (version {version})")
        if kept is not None:
            path, wrote = kept
            if wrote:
                where = f"the spec was written to {path} so every command loads it"
            else:
                where = f"the spec is already in {path}, which every command loads"
            note(f"note: {THROWAWAY_NOTE.format(home=settings.home)}; {where}")


def _spec_files(tools_dir: Any, name: str) -> list[tuple[Any, Any]]:
    """(path, spec) of each spec file of ``tools_dir`` that registers the tool ``name`` (as ``sync_tools``
    reads them: ``*.yaml``/``*.yml``, not hidden, loadable)."""
    from workers.specs import load_spec_file

    found = []
    files = [*tools_dir.glob("*.yaml"), *tools_dir.glob("*.yml")]  # (none when the directory is missing)
    for f in sorted(f for f in files if not f.name.startswith(".")):
        try:
            spec = load_spec_file(f)
        except HermesError:
            continue
        if spec.name == name:
            found.append((f, spec))
    return found


def _keep_spec_file(tools_dir: Any, source: Any, spec: Any, force: bool) -> tuple[Any, bool]:
    """Put ``source`` (the spec ``spec``) in ``tools_dir``: (its path there, whether it was written).

    Already there (the same file, or a file with the same spec): nothing is written. A different spec of
    that name there, or another file at ``<name>.yaml``: an error unless ``force`` (it is overwritten)."""
    import os

    defining = _spec_files(tools_dir, spec.name)
    for path, _ in defining:
        if path.resolve() == source.resolve():
            return path, False
    if defining and all(other.digest() == spec.digest() for _, other in defining):
        return defining[0][0], False
    target = defining[0][0] if defining else tools_dir / f"{spec.name}.yaml"
    if target.exists() and not force:
        fail(
            f"{target} holds a different spec than {source} (every command loads $HERMES_HOME/tools, and this "
            "command's embedded broker ends with it): --force overwrites the file"
        )
    try:
        text = source.read_text(encoding="utf-8")
        tools_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # (hidden: never loaded half-written)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as e:
        fail(f"cannot write {target}: {e.strerror or e}")
    return target, True


@tool.command("show")
@click.argument("name")
@click.pass_context
def tool_show(ctx: click.Context, name: str) -> None:
    """Print one tool's spec."""
    import yaml

    with open_gateway(settings_of(ctx), need_workers=False) as (gw, _):
        sync_tools(gw, write=False)
        with failing():
            entry = gw.tool(name)
        shown = {**entry.spec.to_dict(), "version": entry.version}
        click.echo(yaml.safe_dump(shown, allow_unicode=True, sort_keys=False))


@tool.command("breaker")
@click.argument("name")
@click.option("--reset", is_flag=True, help="Close it now, counters cleared: the next calls reach the back end.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def tool_breaker(ctx: click.Context, name: str, reset: bool, as_json: bool) -> None:
    """Show a tool's circuit breaker (state, failures, last error); --reset closes it, e.g. once the back end
    is fixed, without waiting for the cooldown and its probe. A shared breaker (breaker: {key: ...}) is
    reset for every tool on it."""
    import time

    import yaml

    from broker.breaker import CLOSED, Breakers, Change, breaker_config
    from hermes_gateway.local import THROWAWAY_NOTE, throwaway

    settings = settings_of(ctx)
    with open_gateway(settings, need_workers=False) as (gw, _):
        if throwaway(gw):
            note(f"note: {THROWAWAY_NOTE.format(home=settings.home)}: its breakers are its own, all closed")
        sync_tools(gw, write=reset)
        with failing():
            spec = gw.tool(name).spec
        cfg = breaker_config(settings, spec)
        if cfg is None:
            fail(f"{name} has no circuit breaker (breaker: in its spec, or executors.{spec.executor}.breaker)", 1)
        breakers = Breakers(gw.conn)
        view = breakers.state(cfg.key)
        if reset:
            breakers.reset(cfg.key)
            if view["state"] != CLOSED:  # (serve's console and /metrics hear of it at once)
                breakers.publish(Change(cfg.key, view["state"], CLOSED, "reset by an operator", "", time.time()))
            configs = [(e.spec.name, breaker_config(settings, e.spec)) for e in gw.tools()]
            shared = sorted(n for n, c in configs if c is not None and c.key == cfg.key)
            if as_json:
                click.echo(json.dumps({"key": cfg.key, "reset": True, "was": view["state"], "tools": shared}))
            else:
                click.echo(f"{cfg.key}: reset (was {view['state']}); closed for {', '.join(shared)}")
            return
    click.echo(json.dumps(view) if as_json else yaml.safe_dump(view, sort_keys=False).rstrip())


@tool.command("remove")
@click.argument("name")
@click.option(
    "--delete-file", is_flag=True,
    help="Also delete the spec file in $HERMES_HOME/tools that registers the tool again on every command.",
)
@click.pass_context
def tool_remove(ctx: click.Context, name: str, delete_file: bool) -> None:
    """Remove a tool from the directory (and with --delete-file, its spec file in $HERMES_HOME/tools)."""
    from hermes_gateway.local import THROWAWAY_NOTE, throwaway

    settings = settings_of(ctx)
    files = [path for path, _ in _spec_files(settings.tools_dir, name)]
    where = ", ".join(str(f) for f in files)
    with open_gateway(settings, need_workers=False) as (gw, _):
        sync_tools(gw)  # as list, show and run do: a tool `tool list` shows is known here too
        existed = gw.directory.remove(name)
        if not existed and not files:
            fail(f"unknown tool {name!r}")
        if delete_file:
            for f in files:
                try:
                    f.unlink(missing_ok=True)
                except OSError as e:
                    fail(f"{name}: removed, but {f} could not be deleted: {e.strerror or e}")
            click.echo(f"{name}: removed" + (f"; deleted {where}" if files else ""))
            return
        if files and throwaway(gw):
            fail(
                f"{name} is not removed: {where} registers it for every command, and "
                f"{THROWAWAY_NOTE.format(home=settings.home)}; `hermes-gateway tool remove {name} --delete-file` "
                "deletes that file",
                1,
            )
        click.echo(f"{name}: removed")
        if files:
            note(
                f"{where} registers {name} again on the next command that loads $HERMES_HOME/tools "
                f"(tool list, show, run; serve at start); delete it, or run `hermes-gateway tool remove {name} "
                "--delete-file`",
                "warning",
            )
