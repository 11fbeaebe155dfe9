"""``hermes-gateway flow``: run and check flows of tool calls."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import click

from broker.config import Settings
from broker.errors import HermesError
from hermes_gateway.cli.common import (
    WAIT_SECONDS,
    fail,
    failing,
    note,
    open_gateway,
    print_result,
    read_args_text,
    settings_of,
    sync_tools,
)


@click.group()
def flow() -> None:
    """Run flows of tool calls: serial, parallel, conditional, with breaker fallback."""


def _flow_line(ev: Any, t0: float) -> str:
    call = f" call={ev.call_id[:12]}" if ev.call_id else ""
    extra = " ".join(f"{k}={json.dumps(v, ensure_ascii=False, default=str)}" for k, v in ev.detail.items())
    return f"[{ev.ts - t0:7.3f}s] {ev.step:<16} {ev.state:<9}{call} {extra}".rstrip()


def _known_tools(settings: Settings) -> set[str] | None:
    """The tools ``flow run`` would find: $HERMES_HOME/tools (it registers them) and the shared broker's, or
    None when HERMES_REDIS_URL names a broker that does not answer."""
    from broker.directory import Directory
    from hermes_gateway.local import connect_shared
    from workers.specs import load_spec_dir

    known = {spec.name for spec in load_spec_dir(settings.tools_dir, [])}
    try:
        handle = connect_shared(settings)
    except HermesError as e:
        if settings.broker.url is None:  # (`flow run` would start a broker of its own, with those tools alone)
            return known
        note(f"tools not checked: {e}", "warning")
        return None
    with contextlib.closing(handle):
        return known | {entry.spec.name for entry in Directory(handle.conn).all()}


@flow.command("check")
@click.argument("flow_file", type=click.Path(exists=True, dir_okay=False))
@click.pass_context
def flow_check(ctx: click.Context, flow_file: str) -> None:
    """Validate a flow document (ids, shapes, every expression and the names and steps it reads) and that its
    tools exist (when the broker answers), without running it."""
    from hermes_gateway.flow import load_flow

    with failing():
        f = load_flow(flow_file)
        known = _known_tools(settings_of(ctx))
        if known is not None:
            f.check_tools(known)
    click.echo(f"{f.name}: ok ({len(f.all_steps())} steps{'' if known is not None else '; tools not checked'})")


@flow.command("run")
@click.argument("flow_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--args", "args_text", default="{}",
    help="The flow's arguments: JSON or YAML flow ({city: Paris}); @FILE reads a file, - reads stdin.",
)  # fmt: skip
@click.option("--session-id", default=None)
@click.option("--principal", default=None)
@click.option("--wait", type=WAIT_SECONDS, default=300.0, show_default=True, help="Seconds to wait for each call.")
@click.option("--json", "as_json", is_flag=True, help="Print every step's outcome, not only the result.")
@click.pass_context
def flow_run(
    ctx: click.Context, flow_file: str, args_text: str, session_id: str | None, principal: str | None,
    wait: float, as_json: bool,
) -> None:
    """Run a flow (YAML or JSON), showing each step's state live on stderr; the result goes to stdout."""
    from hermes_gateway.flow import load_flow, run_flow
    from workers.args import parse_args_text

    try:
        parsed = parse_args_text(read_args_text(args_text))
    except HermesError as e:
        fail(f"--args: {e}")
    with failing():
        f = load_flow(flow_file)
    context = {k: v for k, v in (("session_id", session_id), ("principal", principal)) if v}
    t0 = time.time()
    with open_gateway(settings_of(ctx)) as (gw, procs):
        if procs:
            note(f"broker: {gw.description}; started {len(procs)} worker for this flow")
        sync_tools(gw)
        with failing(typed=True):
            show = lambda ev: note(_flow_line(ev, t0))  # noqa: E731
            try:
                outcome = run_flow(gw, f, parsed, on_event=show, wait=wait, **context)
            except KeyboardInterrupt:  # Ctrl-C (FlowRunner.run cancelled the calls it was waiting on)
                fail(f"flow {f.name}: interrupted: its running calls were cancelled", 130)
    note(f"flow {f.name}: {outcome.state} in {time.time() - t0:.3f}s")
    if as_json or outcome.state == "done":  # a failed flow has no result to print (not a bare null)
        print_result(outcome.to_dict() if as_json else outcome.result)
    if outcome.state != "done":
        err = outcome.error or {}
        fail(f"step {err.get('step')}: {err.get('type')}: {err.get('message')}", 1)

