"""The ``hermes-gateway`` command line."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import click

from broker.config import Settings, load_settings
from broker.errors import CallCancelled, CallFailed, CallTimeout, HermesError
from broker.logs import configure


def _settings(ctx: click.Context) -> Settings:
    return ctx.obj["settings"]


def _print_result(result: Any) -> None:
    if isinstance(result, str):
        click.echo(result)
    else:
        click.echo(json.dumps(result, ensure_ascii=False, indent=2, default=str))


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--home", envvar="HERMES_HOME", default=None, help="Config directory (default ~/.hermes).")
@click.option("--log-level", default=None, help="DEBUG, INFO, WARNING, ERROR (default: logging.level or INFO).")
@click.option("--log-format", type=click.Choice(["console", "json"]), default=None, help="Log lines as text or JSON.")
@click.option(
    "--trace",
    type=click.Choice(["off", "console", "otlp"]),
    default=None,
    help="Trace the calls: console prints spans, otlp exports to OTEL_EXPORTER_OTLP_ENDPOINT (default: OTEL_* env).",
)
@click.version_option("0.10.0", prog_name="hermes-gateway", message="%(prog)s v%(version)s")
@click.pass_context
def main(ctx: click.Context, home: str | None, log_level: str | None, log_format: str | None, trace: str | None) -> None:
    """Hermes Gateway: LLM and tool calls through Redis and RQ worker pools."""
    try:
        settings = load_settings(home)
    except HermesError as e:
        _fail(str(e))
    configure(log_level or settings.log_level, log_format or settings.log_format)
    from hermes_gateway.telemetry import setup as setup_tracing

    try:
        setup_tracing(trace)  # workers this command starts inherit the mode
    except HermesError as e:
        _fail(str(e))
    ctx.obj = {"settings": settings}


# -- workers -------------------------------------------------------------------------------------


@main.command()
@click.option("--queues", default="tools,llm", show_default=True, help="Comma-separated queues, in priority order.")
@click.option("--concurrency", "-c", default=16, show_default=True, help="Calls in flight per process.")
@click.option("--processes", "-p", default=1, show_default=True, help="Worker processes to run.")
@click.option("--grace", default=25.0, show_default=True, help="Seconds to finish in-flight calls on SIGTERM.")
@click.pass_context
def worker(ctx: click.Context, queues: str, concurrency: int, processes: int, grace: float) -> None:
    """Run worker processes that take calls off the queues."""
    from broker.connection import connect
    from workers.pool import run_worker, supervise

    settings = _settings(ctx)
    qs = [q.strip() for q in queues.split(",") if q.strip()]
    try:
        handle = connect(settings.redis_url)
    except HermesError as e:
        _fail(str(e))
    click.echo(f"broker: {handle.description}", err=True)
    if handle.embedded is not None:
        click.echo(f"clients reach it with: export HERMES_REDIS_URL={handle.url}", err=True)
    try:
        if processes > 1:
            sys.exit(supervise(handle.url, qs, concurrency, processes, grace))
        sys.exit(run_worker(handle.url, settings, qs, concurrency, grace))
    finally:
        handle.close()


@main.command()
@click.option("--all", "all_", is_flag=True, help="Stop every worker on the broker.")
@click.argument("names", nargs=-1)
@click.pass_context
def stop(ctx: click.Context, all_: bool, names: tuple[str, ...]) -> None:
    """Stop workers gracefully (they finish or hand back in-flight calls)."""
    from broker import keys
    from broker.connection import connect
    from workers.worker import control_message

    if not all_ and not names:
        _fail("name the workers to stop, or pass --all")
    settings = _settings(ctx)
    try:
        handle = connect(settings.redis_url, embedded_ok=False)
    except HermesError as e:
        _fail(str(e))
    if all_:
        reached = handle.conn.publish(keys.channel(handle.conn, keys.CONTROL_CHANNEL), control_message("stop"))
        click.echo(f"stop sent to all workers on {handle.description} ({reached} listening)")
    for name in names:
        handle.conn.publish(keys.channel(handle.conn, keys.CONTROL_CHANNEL), control_message("stop", worker=name))
        click.echo(f"stop sent to {name}")
    handle.close()


# -- tools ---------------------------------------------------------------------------------------


@main.group()
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
        gw.sync_tools()
        entries = gw.tools()
        states = breaker_states(gw.conn, [e.spec for e in entries], settings)
        if as_json:
            click.echo(json.dumps(tool_rows(entries, settings, states), ensure_ascii=False, indent=2))
        else:
            tools_table(entries, settings, states)


@tool.command("run")
@click.argument("name")
@click.argument("args", required=False, default="{}")
@click.option("--follow", "-f", is_flag=True, help="Also print each state transition with its trace id.")
@click.option("--timeout", type=float, default=None, help="Seconds to wait for the result.")
@click.option("--session-id", default=None)
@click.option("--principal", default=None)
@click.pass_context
def tool_run(ctx: click.Context, name: str, args: str, follow: bool, timeout: float | None, session_id: str | None, principal: str | None) -> None:
    """Run one tool call: ARGS is JSON or YAML flow form, e.g. '{name: Alice}'."""
    from workers.args import parse_args_text

    settings = _settings(ctx)
    try:
        parsed = parse_args_text(args)
    except HermesError as e:
        _fail(str(e))
    with _gateway(settings) as (gw, procs):
        if procs:
            click.echo(f"broker: {gw.description}; started {len(procs)} worker for this call", err=True)
        gw.sync_tools()
        try:
            spec = gw.tool(name).spec
            if not procs:
                gw.require_workers(str(spec.config.get("queue") or "tools"))
            context = {k: v for k, v in (("session_id", session_id), ("principal", principal)) if v}
            handle = gw.call_tool(name, parsed, timeout=timeout, **context)
            if follow:
                for ev in handle.events(timeout=timeout):
                    click.echo(_event_line(ev), err=True)
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


def _event_line(ev: Any) -> str:
    label = ev.state if ev.type == "transition" else f"{ev.type}"
    extra = ""
    if ev.type != "transition":
        extra = " " + json.dumps(ev.detail, ensure_ascii=False, default=str)
    elif "error" in ev.detail:
        extra = f" {ev.detail['error'].get('type')}: {ev.detail['error'].get('message')}"
    elif "duration_ms" in ev.detail:
        extra = f" ({ev.detail['duration_ms']:.1f} ms)"
    return f"[{ev.seq:>2}] {label:<10} trace_id={ev.trace_id} attempt={ev.attempt}{extra}"


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
        gw.sync_tools()
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


# -- calls, status, demo -------------------------------------------------------------------------


@main.command()
@click.argument("call_id")
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the call ends.")
@click.pass_context
def events(ctx: click.Context, call_id: str, follow: bool) -> None:
    """Print a call's event history (and its live tail with --follow)."""
    from broker import events as ev_mod

    with _gateway(_settings(ctx), need_workers=False) as (gw, _):
        stream = ev_mod.follow(gw.conn, call_id) if follow else iter(ev_mod.history(gw.conn, call_id))
        for ev in stream:
            click.echo(_event_line(ev))


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--watch", "-w", is_flag=True, help="Live call figures (by tool, state, error; durations, waits, in flight, breakers).")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between refreshes with --watch.")
@click.pass_context
def status(ctx: click.Context, as_json: bool, watch: bool, interval: float) -> None:
    """Queues with depths, workers with in-flight counts, recent failures."""
    from hermes_gateway.views import print_status, status_data

    with _gateway(_settings(ctx), need_workers=False) as (gw, _):
        if watch:
            from hermes_gateway.watch import watch as watch_figures

            watch_figures(gw.conn, interval)
            return
        data = status_data(gw)
        if as_json:
            click.echo(json.dumps(data, indent=2, default=str))
        else:
            print_status(data, gw.description)


@main.command()
@click.option("--calls", "-n", default=300, show_default=True, help="Calls in the batch.")
@click.option("--processes", default=2, show_default=True, help="Worker processes.")
@click.option("--concurrency", default=32, show_default=True, help="Calls in flight per worker process.")
@click.pass_context
def demo(ctx: click.Context, calls: int, processes: int, concurrency: int) -> None:
    """Start a broker and a worker pool, run a batch of calls live, and summarise."""
    from hermes_gateway.demo import run_demo

    try:
        sys.exit(run_demo(_settings(ctx), calls=calls, processes=processes, concurrency=concurrency))
    except HermesError as e:
        _fail(str(e))


@contextlib.contextmanager
def _gateway(settings: Settings, need_workers: bool = True) -> Iterator[tuple[Any, list[Any]]]:
    """The gateway for one command; broker errors become a clear message and exit code 2."""
    from hermes_gateway.local import local_stack

    with contextlib.ExitStack() as stack:
        try:
            pair = stack.enter_context(local_stack(settings, need_workers=need_workers))
        except HermesError as e:
            _fail(str(e))
        yield pair


# -- plugins and policy --------------------------------------------------------------------------


@main.group()
def plugins() -> None:
    """Enable, disable, list and reload middleware plugins (same config.yaml as the Hermes agent)."""


@plugins.command("list")
@click.pass_context
def plugins_list(ctx: click.Context) -> None:
    """Every plugin found, and whether it is enabled."""
    from middleware import list_plugins

    found = list_plugins(_settings(ctx).home)
    if not found:
        click.echo(f"no plugins in {_settings(ctx).plugins_dir} or the hermes_agent.plugins entry points")
    for info in found:
        mark = "enabled " if info.enabled else "disabled"
        err = f"  error: {info.error}" if info.error else ""
        click.echo(f"{mark}  {info.name:<32} {info.source:<12} {info.description or ''}{err}")


@plugins.command("enable")
@click.argument("name")
@click.pass_context
def plugins_enable(ctx: click.Context, name: str) -> None:
    """Enable a plugin (written to plugins.enabled in config.yaml)."""
    from middleware import enable_plugin

    try:
        key = enable_plugin(_settings(ctx).home, name)
    except LookupError as e:
        _fail(str(e))
    click.echo(f"enabled {key}; running workers pick it up with `hermes-gateway plugins reload`")


@plugins.command("disable")
@click.argument("name")
@click.pass_context
def plugins_disable(ctx: click.Context, name: str) -> None:
    """Disable a plugin."""
    from middleware import disable_plugin

    try:
        key = disable_plugin(_settings(ctx).home, name)
    except LookupError as e:
        _fail(str(e))
    click.echo(f"disabled {key}")


@plugins.command("reload")
@click.pass_context
def plugins_reload(ctx: click.Context) -> None:
    """Make every running worker re-import its plugins (and re-read policy) without a restart."""
    from broker import keys
    from broker.connection import connect
    from workers.worker import control_message

    try:
        handle = connect(_settings(ctx).redis_url, embedded_ok=False)
    except HermesError as e:
        _fail(str(e))
    reached = handle.conn.publish(keys.channel(handle.conn, keys.CONTROL_CHANNEL), control_message("reload"))
    click.echo(f"reload sent to workers on {handle.description} ({reached} listening)")
    handle.close()


@main.group()
def policy() -> None:
    """Inspect the permission policy."""


@policy.command("explain")
@click.argument("principal")
@click.argument("tool_name")
@click.pass_context
def policy_explain(ctx: click.Context, principal: str, tool_name: str) -> None:
    """Why PRINCIPAL may or may not call TOOL (the 'listed but permission denied' question)."""
    from workers.policy import Policy

    settings = _settings(ctx)
    with _gateway(settings, need_workers=False) as (gw, _):
        gw.sync_tools()
        try:
            spec = gw.tool(tool_name).spec
            from workers.policy_store import active

            pol, _ = active(gw.conn, Policy.from_settings(settings.policy))  # the pushed policy wins
        except HermesError as e:
            _fail(str(e))
        click.echo(pol.explain(principal, spec))


# -- audit log and the active policy (hermes_gateway/audit_cli.py, hermes_gateway/policy_cli.py) --

from hermes_gateway.audit_cli import audit  # noqa: E402 - the commands register onto the groups above
from hermes_gateway.policy_cli import policy_clear, policy_push, policy_show  # noqa: E402

main.add_command(audit)
for _command in (policy_push, policy_show, policy_clear):
    policy.add_command(_command)


# -- filling the directory in bulk (hermes_gateway/directory_cli.py) -----------------------------

from hermes_gateway.directory_cli import mcp, migrate  # noqa: E402 - commands defined beside their helpers

main.add_command(migrate)
main.add_command(mcp)


# -- chat: a minimal agent loop over the queue (hermes_gateway/chat.py) ---------------------------


@main.command()
@click.option("--query", "-q", required=True, help="The user message.")
@click.option("--max-turns", default=8, show_default=True, help="LLM calls at most before giving up.")
@click.option("--stream", is_flag=True, help="Print the answer's text as it arrives.")
@click.option("--verbose", "-v", is_flag=True, help="Also print each LLM and tool call (to stderr).")
@click.option("--system", default=None, help="A system message.")
@click.option("--principal", default=None, help="Offer only the tools this principal may call.")
@click.option("--session-id", default=None)
@click.option("--model", default=None, help="Override model.model of config.yaml.")
@click.option("--tools", "only", default=None, help="Comma-separated tool names to offer (default: all allowed).")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for any one call.")
@click.pass_context
def chat(
    ctx: click.Context, query: str, max_turns: int, stream: bool, verbose: bool, system: str | None,
    principal: str | None, session_id: str | None, model: str | None, only: str | None, timeout: float,
) -> None:
    """Ask the model through the gateway; its tool calls run on the workers, in parallel."""
    from hermes_gateway.chat import ChatSession, describe_turn

    # "open": deltas printed and the line not yet ended; "answer_shown": the final answer was streamed.
    shown = {"open": False, "answer_shown": False}

    def on_delta(text: str) -> None:
        shown["open"] = True
        click.echo(text, nl=False)

    def on_turn(turn: Any) -> None:
        shown["answer_shown"] = shown["open"] and not turn.tools
        if shown["open"]:
            click.echo("")
            shown["open"] = False
        if verbose:
            for line in describe_turn(turn):
                click.echo(line, err=True)

    settings = _settings(ctx)
    with _gateway(settings) as (gw, procs):
        if verbose and procs:
            click.echo(f"broker: {gw.description}; started {len(procs)} worker for this chat", err=True)
        gw.sync_tools()
        try:
            if not procs:
                gw.require_workers("llm")
            session = ChatSession(
                gw, principal=principal, session_id=session_id, system=system, model=model,
                max_turns=max_turns, stream=stream, wait=timeout, on_delta=on_delta, on_turn=on_turn,
                tools=[t.strip() for t in only.split(",") if t.strip()] if only else None,
            )
            result = session.ask(query)
        except CallCancelled as e:
            _fail(f"cancelled: {e}", 1)
        except (CallTimeout, CallFailed) as e:
            _fail(f"{e.type}: {e}", 1)
        except HermesError as e:
            _fail(f"{e.type}: {e}")
        if verbose:
            click.echo(f"session {result.session_id}: {len(result.turns)} LLM call(s)", err=True)
        if result.answer is None:
            _fail(f"no answer within {max_turns} turn(s) (--max-turns)", 1)
        if not shown["answer_shown"]:
            click.echo(result.answer)


# -- flows (orchestration) ---------------------------------------------------------------------------


@main.group()
def flow() -> None:
    """Run flows of tool calls: serial, parallel, conditional, with breaker fallback."""


def _flow_line(ev: Any, t0: float) -> str:
    call = f" call={ev.call_id[:12]}" if ev.call_id else ""
    extra = " ".join(f"{k}={json.dumps(v, ensure_ascii=False, default=str)}" for k, v in ev.detail.items())
    return f"[{ev.ts - t0:7.3f}s] {ev.step:<16} {ev.state:<9}{call} {extra}".rstrip()


@flow.command("check")
@click.argument("flow_file", type=click.Path(exists=True, dir_okay=False))
def flow_check(flow_file: str) -> None:
    """Validate a flow document (ids, shapes, every expression) without running it."""
    from hermes_gateway.flow import load_flow

    try:
        f = load_flow(flow_file)
    except HermesError as e:
        _fail(str(e))
    click.echo(f"{f.name}: ok ({len(f.all_steps())} steps)")


@flow.command("run")
@click.argument("flow_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--args", "args_text", default="{}", help="The flow's arguments as a JSON object.")
@click.option("--session-id", default=None)
@click.option("--principal", default=None)
@click.option("--wait", type=float, default=300.0, show_default=True, help="Seconds to wait for each call.")
@click.option("--json", "as_json", is_flag=True, help="Print every step's outcome, not only the result.")
@click.pass_context
def flow_run(
    ctx: click.Context,
    flow_file: str,
    args_text: str,
    session_id: str | None,
    principal: str | None,
    wait: float,
    as_json: bool,
) -> None:
    """Run a flow (YAML or JSON), showing each step's state live on stderr; the result goes to stdout."""
    import time

    from hermes_gateway.flow import load_flow, run_flow

    try:
        parsed = json.loads(args_text)
    except ValueError as e:
        _fail(f"--args: not valid JSON: {e}")
    if not isinstance(parsed, dict):
        _fail("--args: expected a JSON object")
    try:
        f = load_flow(flow_file)
    except HermesError as e:
        _fail(str(e))
    context = {k: v for k, v in (("session_id", session_id), ("principal", principal)) if v}
    t0 = time.time()
    with _gateway(_settings(ctx)) as (gw, procs):
        if procs:
            click.echo(f"broker: {gw.description}; started {len(procs)} worker for this flow", err=True)
        gw.sync_tools()
        try:
            show = lambda ev: click.echo(_flow_line(ev, t0), err=True)  # noqa: E731
            outcome = run_flow(gw, f, parsed, on_event=show, wait=wait, **context)
        except HermesError as e:
            _fail(f"{e.type}: {e}")
    click.echo(f"flow {f.name}: {outcome.state} in {time.time() - t0:.3f}s", err=True)
    _print_result(outcome.to_dict() if as_json else outcome.result)
    if outcome.state != "done":
        err = outcome.error or {}
        _fail(f"step {err.get('step')}: {err.get('type')}: {err.get('message')}", 1)
