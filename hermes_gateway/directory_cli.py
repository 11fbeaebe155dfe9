"""``hermes-gateway migrate`` and ``hermes-gateway mcp add``: filling the tool directory in bulk."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict
from typing import Any

import click

from broker.config import Settings
from broker.errors import HermesError
from hermes_gateway.cli_common import WAIT_SECONDS, _fail, _note, _sync_tools


def _settings(ctx: click.Context) -> Settings:
    return ctx.find_root().obj["settings"]


def _stack(settings: Settings) -> Any:
    from hermes_gateway.local import local_stack

    try:
        return local_stack(settings, need_workers=False)
    except HermesError as e:
        _fail(str(e))


def _line(status: str, name: str, version: int | None, source: str, reason: str) -> str:
    ver = f"v{version}" if version is not None else "-"
    return f"{status:<10} {name:<28} {ver:<6} {source}" + (f"  ({reason})" if reason else "")


@click.command()
@click.option(
    "--force", is_flag=True, help="Replace tools the directory already holds with a different spec."
)
@click.option("--dry-run", is_flag=True, help="Report what would happen; change nothing.")
@click.option("--no-rewrite", is_flag=True, help="Leave old per-file specs in tools/ as they are.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.pass_context
def migrate(ctx: click.Context, force: bool, dry_run: bool, no_rewrite: bool, as_json: bool) -> None:
    """Import the v0.9 tool files ($HERMES_HOME/tools.json, tools/*) into the tool directory."""
    from hermes_gateway.migrate import migrate as run_migration

    settings = _settings(ctx)
    with _stack(settings) as (gw, _):
        embedded = gw.broker.embedded is not None
        try:
            outcomes = run_migration(
                gw.directory,
                settings.home,
                force=force,
                rewrite=not no_rewrite,
                dry_run=dry_run,
                to_files=embedded,
            )
        except OSError as e:
            _fail(f"cannot read the old tool files: {e}")
    if as_json:
        click.echo(json.dumps([asdict(o) for o in outcomes], ensure_ascii=False, indent=2))
        if any(o.failed for o in outcomes):
            sys.exit(1)
        return
    if not outcomes:
        click.echo(f"nothing to migrate: no tools.json, tools.yaml or tools/ specs in {settings.home}")
        return
    for o in outcomes:
        click.echo(_line(o.status, o.name, o.version, o.source, o.reason))
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    click.echo(f"{'dry run: ' if dry_run else ''}{summary}")
    if embedded:
        _note(
            "note: the embedded broker lasts only for this command; the specs were written to "
            f"{settings.tools_dir} so every command loads them. Set HERMES_REDIS_URL to fill a shared directory."
        )
    failed = [o for o in outcomes if o.failed]
    if failed:  # scripts see it: the rest was migrated, these were not
        _fail(
            f"{len(failed)} spec(s) could not be migrated (see 'skipped' above); fix them and run migrate again",
            1,
        )


@click.group()
def mcp() -> None:
    """Import MCP servers' tools into the directory, list and remove them by server; serve the directory
    to MCP clients."""


@mcp.command("add")
@click.argument("server_name")
@click.option("--command", "command", default=None, help='Start a stdio server, e.g. "uvx mcp-server-fetch".')
@click.option("--url", default=None, help="A streamable-HTTP server, e.g. http://127.0.0.1:8000/mcp.")
@click.option("--prefix", default="", help="Put before every tool name (e.g. fs_), to keep servers apart.")
@click.option("--env", "env", multiple=True, help="KEY=VALUE for a stdio server's environment (repeatable).")
@click.option(
    "--timeout",
    type=WAIT_SECONDS,
    default=None,
    help="Seconds to connect and list (executors.mcp.handshake_timeout).",
)
@click.option("--force", is_flag=True, help="Replace tools of another origin that have the same names.")
@click.pass_context
def mcp_add(
    ctx: click.Context,
    server_name: str,
    command: str | None,
    url: str | None,
    prefix: str,
    env: tuple[str, ...],
    timeout: float | None,
    force: bool,
) -> None:
    """Register every tool of an MCP server (SERVER_NAME labels it) as an mcp tool."""
    from hermes_gateway.mcp_import import import_server

    if bool(command) == bool(url):
        _fail("give the server as exactly one of --command or --url")
    server: dict[str, Any] = {"url": url} if url else {"command": shlex.split(command or "")}
    if env:
        pairs = [e.partition("=") for e in env]
        if any(not sep for _, sep, _ in pairs):
            _fail("--env expects KEY=VALUE")
        server["env"] = {k: v for k, _, v in pairs}
    settings = _settings(ctx)
    handshake = timeout or float(settings.executor_settings("mcp").get("handshake_timeout", 10.0))
    with _stack(settings) as (gw, _):
        try:
            results = import_server(
                gw.directory,
                server,
                prefix=prefix,
                handshake_timeout=handshake,
                write_dir=settings.tools_dir if gw.broker.embedded is not None else None,
                label=server_name,
                tools_dir=settings.tools_dir,
                force=force,
            )
        except HermesError as e:
            _fail(f"{server_name}: {e}", 1)
    for r in results:
        click.echo(_line(r.status, r.name, r.version, server_name, r.reason))
    added = sum(r.status in ("added", "updated") for r in results)
    click.echo(f"{server_name}: {len(results)} tools, {added} added or updated")


@mcp.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: {server: [tool names]}.")
@click.pass_context
def mcp_list(ctx: click.Context, as_json: bool) -> None:
    """The MCP servers whose tools `mcp add` imported, with their tools."""
    from hermes_gateway.mcp_import import servers

    with _stack(_settings(ctx)) as (gw, _):
        found = servers(gw.directory)
    if as_json:
        click.echo(json.dumps({label: [s.name for s in specs] for label, specs in found.items()}))
        return
    if not found:
        click.echo(
            "no MCP server imported (add one with `hermes-gateway mcp add NAME --command ...|--url ...`)"
        )
        return
    for label, specs in found.items():
        server = specs[0].config.get("mcp") or {}
        target = (
            _shown_url(str(server["url"]))
            if server.get("url")
            else " ".join(map(str, server.get("command") or []))
        )
        click.echo(f"{label}: {len(specs)} tools  ({target})")
        for spec in specs:
            click.echo(f"  {spec.name}")


def _shown_url(url: str) -> str:
    """A server URL without what may be a credential: the password and the query string."""
    from broker.connection import redact_url

    base, query, _ = url.partition("?")
    return redact_url(base.split("#", 1)[0]) + ("?***" if query else "")


@mcp.command("remove")
@click.argument("server_name")
@click.pass_context
def mcp_remove(ctx: click.Context, server_name: str) -> None:
    """Remove every tool `mcp add SERVER_NAME` imported (other tools are left alone)."""
    from hermes_gateway.mcp_import import remove_server

    settings = _settings(ctx)
    with _stack(settings) as (gw, _):
        removed = remove_server(
            gw.directory,
            server_name,
            write_dir=settings.tools_dir if gw.broker.embedded is not None else None,
        )
    if not removed:
        _fail(
            f"no tools were imported from an MCP server named {server_name!r} (see `hermes-gateway mcp list`)",
            1,
        )
    for name in removed:
        click.echo(f"removed    {name}")
    click.echo(f"{server_name}: {len(removed)} tools removed")


@mcp.command("serve")
@click.option(
    "--principal",
    default=None,
    help="Who the calls run as: offer and allow only what the policy lets it call.",
)
@click.option("--session-id", default=None, help="Put on every call's context (events, audit, traces).")
@click.option(
    "--timeout",
    type=WAIT_SECONDS,
    default=None,
    help="Seconds to wait for a call (default: the tool's timeout).",
)
@click.pass_context
def mcp_serve(
    ctx: click.Context, principal: str | None, session_id: str | None, timeout: float | None
) -> None:
    """Serve the directory's tools to an MCP client over stdio (the client starts this command).

    \b
    Every call goes through the gateway and its workers (limits, policy, audit, events). Without
    HERMES_REDIS_URL it starts the embedded broker and a local worker, as `tool run` does.
    For the Hermes agent, in its config.yaml:
      mcp_servers:
        gateway: {command: hermes-gateway, args: [mcp, serve]}
    """
    import asyncio
    import signal
    import sys

    from hermes_gateway.local import local_stack
    from workers.executors.mcp_session import require_sdk

    try:
        require_sdk("`mcp serve`")
    except HermesError as e:
        _fail(str(e))
    from hermes_gateway.mcp_serve import serve_stdio

    settings = _settings(ctx)
    # The broker and the local worker start before the protocol does: a failure is a plain error, and the
    # worker writes its standard output to our stderr, never into the protocol on our stdout.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))  # a client stopping us: clean up
    try:
        with local_stack(settings, worker_stdout=sys.stderr.fileno()) as (gw, procs):
            _sync_tools(gw)
            asyncio.run(
                serve_stdio(
                    gw, principal=principal, session_id=session_id, timeout=timeout, need_workers=not procs
                )
            )
    except HermesError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        pass
