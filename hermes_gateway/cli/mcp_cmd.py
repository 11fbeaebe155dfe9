"""``hermes-gateway mcp add|list|remove|serve``: MCP servers' tools in the directory, and the directory as
an MCP server."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any

import click

from broker.errors import HermesError
from hermes_gateway.cli.common import WAIT_SECONDS, fail, open_gateway, outcome_line, settings_of, sync_tools


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
    "--timeout", type=WAIT_SECONDS, help="Seconds to connect and list (executors.mcp.handshake_timeout)."
)
@click.option("--force", is_flag=True, help="Replace tools of another origin that have the same names.")
@click.pass_context
def mcp_add(
    ctx: click.Context, server_name: str, command: str | None, url: str | None, prefix: str,
    env: tuple[str, ...], timeout: float | None, force: bool,
) -> None:
    """Register every tool of an MCP server (SERVER_NAME labels it) as an mcp tool."""
    from hermes_gateway.mcp_import import import_server

    if bool(command) == bool(url):
        fail("give the server as exactly one of --command or --url")
    server: dict[str, Any] = {"url": url} if url else {"command": shlex.split(command or "")}
    if env:
        pairs = [e.partition("=") for e in env]
        if any(not sep for _, sep, _ in pairs):
            fail("--env expects KEY=VALUE")
        server["env"] = {k: v for k, _, v in pairs}
    settings = settings_of(ctx)
    handshake = timeout or float(settings.executor_settings("mcp").get("handshake_timeout", 10.0))
    with open_gateway(settings, need_workers=False) as (gw, _):
        try:
            results = import_server(
                gw.directory, server, prefix=prefix, handshake_timeout=handshake,
                write_dir=settings.tools_dir if gw.broker.embedded is not None else None,
                label=server_name, tools_dir=settings.tools_dir, force=force,
            )
        except HermesError as e:
            fail(f"{server_name}: {e}", 1)
    for r in results:
        click.echo(outcome_line(r.status, r.name, r.version, server_name, r.reason))
    added = sum(r.status in ("added", "updated") for r in results)
    click.echo(f"{server_name}: {len(results)} tools, {added} added or updated")


@mcp.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: {server: [tool names]}.")
@click.pass_context
def mcp_list(ctx: click.Context, as_json: bool) -> None:
    """The MCP servers whose tools `mcp add` imported, with their tools."""
    from hermes_gateway.mcp_import import servers

    with open_gateway(settings_of(ctx), need_workers=False) as (gw, _):
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
        if server.get("url"):
            target = _shown_url(str(server["url"]))
        else:
            target = " ".join(map(str, server.get("command") or []))
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

    settings = settings_of(ctx)
    with open_gateway(settings, need_workers=False) as (gw, _):
        write_dir = settings.tools_dir if gw.broker.embedded is not None else None
        removed = remove_server(gw.directory, server_name, write_dir=write_dir)
    if not removed:
        fail(f"no tools were imported from an MCP server named {server_name!r} "
             "(see `hermes-gateway mcp list`)", 1)
    for name in removed:
        click.echo(f"removed    {name}")
    click.echo(f"{server_name}: {len(removed)} tools removed")


@mcp.command("serve")
@click.option("--principal", help="Who the calls run as: offer and allow only what the policy lets it call.")
@click.option("--session-id", help="Put on every call's context (events, audit, traces).")
@click.option(
    "--timeout", type=WAIT_SECONDS, help="Seconds to wait for a call (default: the tool's timeout)."
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

    from hermes_gateway.local import local_stack
    from workers.executors.mcp_session import require_sdk

    try:
        require_sdk("`mcp serve`")
    except HermesError as e:
        fail(str(e))
    from hermes_gateway.mcp_serve import serve_stdio

    settings = settings_of(ctx)
    # The broker and the local worker start before the protocol does: a failure is a plain error, and the
    # worker writes its standard output to our stderr, never into the protocol on our stdout.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))  # a client stopping us: clean up
    try:
        with local_stack(settings, worker_stdout=sys.stderr.fileno()) as (gw, procs):
            sync_tools(gw)
            options = {"principal": principal, "session_id": session_id, "timeout": timeout}
            asyncio.run(serve_stdio(gw, need_workers=not procs, **options))
    except HermesError as e:
        fail(str(e))
    except KeyboardInterrupt:
        pass
