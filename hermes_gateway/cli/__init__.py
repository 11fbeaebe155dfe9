"""The ``hermes-gateway`` command line: the root group, its own commands (worker, stop, events, status,
demo), and the command groups of ``hermes_gateway/cli/<group>_cmd.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from itertools import islice
from typing import Any

import click

from broker.config import LOG_LEVELS, RUN_REGISTRY_ENV, load_settings
from broker.errors import HermesError
from broker.logs import configure
from hermes_gateway.cli.audit_cmd import audit
from hermes_gateway.cli.batch_cmd import batch
from hermes_gateway.cli.chat_cmd import chat
from hermes_gateway.cli.common import (
    POSITIVE,
    SECONDS,
    WAIT_SECONDS,
    check_queues,
    event_line,
    fail,
    failing,
    note,
    open_gateway,
    settings_of,
)
from hermes_gateway.cli.flow_cmd import flow
from hermes_gateway.cli.mcp_cmd import mcp
from hermes_gateway.cli.migrate_cmd import migrate
from hermes_gateway.cli.plugins_cmd import plugins
from hermes_gateway.cli.policy_cmd import policy
from hermes_gateway.cli.serve_cmd import serve
from hermes_gateway.cli.tool_cmd import tool

__all__ = ["main"]


# Group options a user may also write after the command (`worker --log-format json`): moved in front of it.
_ANYWHERE = ("--log-level", "--log-format", "--home", "--trace")


class _Main(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        at = 0  # the command's name: the first word that is not a global option or its value
        while at < len(args) and args[at] not in self.commands:
            at += 2 if args[at] in _ANYWHERE else 1
        front, rest = list(args[:at]), []
        tail = iter(args[at:])
        for arg in tail:
            if arg == "--":
                rest += [arg, *tail]  # (the rest, as it is)
            elif arg.split("=", 1)[0] in _ANYWHERE:
                front += [arg] if "=" in arg else [arg, *islice(tail, 1)]  # with its value
            else:
                rest.append(arg)
        return super().parse_args(ctx, front + rest)

    def invoke(self, ctx: click.Context) -> Any:
        import redis

        try:
            return super().invoke(ctx)
        except (redis.ConnectionError, redis.TimeoutError) as e:  # one line, not a traceback
            fail(f"broker_unavailable: the broker did not answer: {e}", 1)
        except redis.exceptions.OutOfMemoryError as e:
            from broker.connection import out_of_memory

            fail(f"broker_full: {out_of_memory(e)}", 1)


# The command groups are one module each (hermes_gateway/cli/<group>_cmd.py); the root's commands are below.
@click.group(
    cls=_Main, context_settings={"help_option_names": ["-h", "--help"]},
    commands=[tool, batch, plugins, policy, audit, migrate, mcp, chat, flow, serve],
)
@click.option(
    "--home", envvar="HERMES_HOME", show_envvar=True,
    help="Config directory: config.yaml, tools/, plugins/ (default $HERMES_HOME, else ~/.hermes).",
)
@click.option(
    "--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
    help="DEBUG, INFO, WARNING, ERROR (default: logging.level or INFO).",
)
@click.option("--log-format", type=click.Choice(["console", "json"]), help="Log lines as text or JSON.")
@click.option(
    "--trace", type=click.Choice(["off", "console", "otlp", "zipkin"]),
    help="Trace the calls: console prints spans, otlp exports to OTEL_EXPORTER_OTLP_ENDPOINT, zipkin to "
    "OTEL_EXPORTER_ZIPKIN_ENDPOINT (default: OTEL_* env).",
)
@click.version_option("0.10.0", prog_name="hermes-gateway", message="%(prog)s v%(version)s")
@click.pass_context
def main(
    ctx: click.Context, home: str | None, log_level: str | None, log_format: str | None, trace: str | None
) -> None:
    """Hermes Gateway: LLM and tool calls through Redis and RQ worker pools."""
    configure(log_level or "INFO", log_format or "console")  # until the config is read (its errors, too)
    with failing():
        settings = load_settings(home)
    was = settings.logging  # the command line wins over the environment and config.yaml
    asked = dataclasses.replace(
        was, level=log_level or was.level, format=log_format or was.format,
        level_set=was.level_set or bool(log_level),
    )
    settings = dataclasses.replace(settings, logging=asked)
    configure(asked.level, asked.format)
    for problem in settings.unknown_keys:
        note(problem, "warning")
    # Written, not read: processes this command starts (a pool's workers, a chat's worker) log the same way.
    if log_level:
        os.environ["HERMES_LOG_LEVEL"] = log_level
    if log_format:
        os.environ["HERMES_LOG_FORMAT"] = log_format
    from hermes_gateway.tracing import setup as setup_tracing

    with failing():
        setup_tracing(settings.telemetry, trace)  # workers this command starts inherit the mode
    ctx.obj = {"settings": settings}


# -- workers -------------------------------------------------------------------------------------


@main.command()
@click.option(
    "--queues", default="tools,llm", show_default=True, callback=check_queues,
    help="Comma-separated queues, in priority order.",
)  # fmt: skip
@click.option(
    "--concurrency", "-c", default=16, show_default=True, type=POSITIVE, help="Calls in flight per process."
)
@click.option(
    "--processes", "-p", default=1, show_default=True, type=POSITIVE, help="Worker processes to run."
)
@click.option(
    "--grace", default=25.0, show_default=True, type=SECONDS,
    help="Seconds to finish in-flight calls on SIGTERM.",
)
@click.option(
    "--metrics-port", type=click.IntRange(1, 65535),
    help="Serve Prometheus /metrics on this port (process i of --processes on PORT+i).",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address of /metrics.")
@click.pass_context
def worker(
    ctx: click.Context, queues: str, concurrency: int, processes: int, grace: float, metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run worker processes that take calls off the queues."""
    from broker.connection import connect
    from workers import runfiles
    from workers.pool import run_worker, supervise

    settings = settings_of(ctx)
    qs = [q.strip() for q in queues.split(",") if q.strip()]
    # This process, its pool's children and its embedded broker go in the run registry of our home, so
    # `stop --all` on this machine finds them (with or without a broker URL configured).
    runfiles.enable(settings.home)
    # Written, not read: the environment of the pool's children (same config, same run registry).
    os.environ["HERMES_HOME"] = str(settings.home)
    os.environ[RUN_REGISTRY_ENV] = "1"
    if metrics_port is not None:  # the command line wins over HERMES_METRICS_PORT / HERMES_METRICS_HOST
        metrics = dataclasses.replace(settings.workers, metrics_port=metrics_port, metrics_host=metrics_host)
        settings = dataclasses.replace(settings, workers=metrics)
    with failing():
        handle = connect(settings.broker.url)
    note(f"broker: {handle.description}")
    if handle.embedded is not None:
        note(f"clients reach it with: export HERMES_REDIS_URL={handle.url}")
    with contextlib.closing(handle), failing():
        if processes > 1:
            sys.exit(supervise(handle.url, qs, concurrency, processes, grace, settings.workers))
        sys.exit(run_worker(handle.url, settings, qs, concurrency, grace))


@main.command()
@click.option(
    "--all", "all_", is_flag=True,
    help="Stop every worker on the broker, and every process our commands run on this machine (serve, "
    "workers, embedded brokers).",
)
@click.option(
    "--grace", default=30.0, show_default=True, type=SECONDS,
    help="With --all: seconds this machine's processes get to exit after SIGTERM before SIGKILL (a worker "
    "finishes its calls within its own --grace, 25 s by default).",
)
@click.argument("names", nargs=-1)
@click.pass_context
def stop(ctx: click.Context, all_: bool, grace: float, names: tuple[str, ...]) -> None:
    """Stop workers gracefully (they finish or hand back in-flight calls); with --all, also stop what
    runs on this machine from its run registry ($HERMES_HOME/run), so `serve` frees its port."""
    from broker import keys
    from broker.codec import text
    from hermes_gateway.local import connect_shared
    from workers import runfiles
    from workers.worker import control_message

    if not all_ and not names:
        fail("name the workers to stop, or pass --all")
    settings = settings_of(ctx)
    broker_error: str | None = None
    if names or settings.broker.url:
        try:
            handle = connect_shared(settings)
        except HermesError as e:
            if names:  # (without --all there are names)
                fail(str(e))
            broker_error = str(e)  # still stop what runs here
        else:
            channel = keys.channel(handle.conn, keys.CONTROL_CHANNEL)
            if all_:
                reached = handle.conn.publish(channel, control_message("stop"))
                click.echo(f"stop sent to all workers on {handle.description} ({reached} listening)")
            known = {text(n) for n in handle.conn.zrange(keys.WORKERS, 0, -1)}
            unknown = [name for name in names if name not in known]
            for name in names:
                if name in known:
                    handle.conn.publish(channel, control_message("stop", worker=name))
                    click.echo(f"stop sent to {name}")
            handle.close()
            if unknown:  # a typo must not read as done
                shown = ", ".join(sorted(known)) or "none"
                fail(
                    f"no such worker: {', '.join(unknown)} (workers on this broker: {shown}; "
                    "see `hermes-gateway status`)",
                    1,
                )
    if not all_:
        return

    results = {
        "stopped": "stopped",
        "exited": "stopped (with its parent)",
        "killed": f"killed (still running {grace:g}s after SIGTERM)",
        "stale": "was not running (stale run file removed)",
        "failed": "could not be stopped",
    }
    outcomes = runfiles.stop_all(
        settings.home, grace, report=lambda o: click.echo(f"{o.entry.describe()}: {results[o.result]}")
    )
    if not any(o.result != "stale" for o in outcomes):
        click.echo(f"nothing running on this machine (run registry {runfiles.run_dir(settings.home)})")
    if broker_error is not None:
        fail(f"the stop message could not be sent: {broker_error}")
    if any(o.result == "failed" for o in outcomes):
        sys.exit(1)


# -- calls, status, demo -------------------------------------------------------------------------


@main.command()
@click.argument("call_id")
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the call ends.")
@click.option(
    "--request", "show_request", is_flag=True,
    help="First print what the call asked for, secrets masked: a tool call's args, an LLM call's whole "
    "request (the messages the model is sent, tool results included).",
)
@click.pass_context
def events(ctx: click.Context, call_id: str, follow: bool, show_request: bool) -> None:
    """Print a call's event history (and its live tail with --follow)."""
    from broker import events as ev_mod
    from hermes_gateway.views import call_request
    from hermes_gateway.watch import call_known

    with open_gateway(settings_of(ctx), need_workers=False) as (gw, _):
        if not call_known(gw.conn, call_id):
            fail(f"no such call {call_id} (unknown, or past its result TTL)", 1)
        if show_request:
            from broker.audit import AuditLog

            asked = call_request(gw.conn, call_id, AuditLog.from_settings(gw.conn, gw.settings.audit))
            if asked is None:
                fail(f"no such call {call_id} (unknown, or past its result TTL)", 1)
            click.echo(json.dumps(asked, ensure_ascii=False, indent=2, default=str))
        stream = ev_mod.follow(gw.conn, call_id) if follow else iter(ev_mod.filled(ev_mod.history(gw.conn, call_id)))
        last = 0
        for ev in stream:
            if ev.seq > last + 1:  # (an ended call keeps its moves, not its progress events or stream deltas)
                missing = ev.seq - last - 1
                click.echo(
                    f"     ({missing} event{'s' if missing > 1 else ''} not kept once the call ended: progress "
                    "messages or stream deltas; workers.keep_history keeps them)"
                )
            last = max(last, ev.seq)
            click.echo(event_line(ev))


@main.command()
@click.option(
    "--json", "as_json", is_flag=True,
    help="Plain data, live figures included; with --watch one JSON line per refresh.",
)
@click.option(
    "--watch", "-w", is_flag=True,
    help="Live call figures (by tool, state, error; durations, waits, in flight, breakers).",
)
@click.option(
    "--interval", default=1.0, show_default=True, type=WAIT_SECONDS, help="Seconds between refreshes with --watch."
)
@click.pass_context
def status(ctx: click.Context, as_json: bool, watch: bool, interval: float) -> None:
    """Queues with depths, workers with in-flight counts, recent failures."""
    from hermes_gateway.local import THROWAWAY_NOTE, throwaway
    from hermes_gateway.views import print_status, status_data

    with open_gateway(settings_of(ctx), need_workers=False) as (gw, _):
        if throwaway(gw):
            throwaway_note = THROWAWAY_NOTE.format(home=settings_of(ctx).home)
            note(f"note: {throwaway_note}: this status is of an empty broker of its own")
        if watch:
            from hermes_gateway.watch import watch as watch_figures
            from hermes_gateway.watch import watch_json

            if as_json:
                watch_json(gw.conn, interval)
            else:
                watch_figures(gw.conn, interval)
            return
        data = status_data(gw, figures=as_json)
        if as_json:
            click.echo(json.dumps(data, indent=2, default=str))
        else:
            print_status(data, gw.description)


@main.command()
@click.option("--calls", "-n", default=300, show_default=True, type=POSITIVE, help="Calls in the batch.")
@click.option("--processes", default=2, show_default=True, type=POSITIVE, help="Worker processes.")
@click.option(
    "--concurrency", default=32, show_default=True, type=POSITIVE, help="Calls in flight per worker process."
)
@click.pass_context
def demo(ctx: click.Context, calls: int, processes: int, concurrency: int) -> None:
    """Start a broker and a worker pool, run a batch of calls live, and summarise."""
    from hermes_gateway.demo import run_demo

    with failing():
        sys.exit(run_demo(settings_of(ctx), calls=calls, processes=processes, concurrency=concurrency))
