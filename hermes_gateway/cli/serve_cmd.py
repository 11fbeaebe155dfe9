"""``hermes-gateway serve``: the HTTP/SSE API, ``/mcp`` and the web console (``hermes_gateway/http_api.py``)."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from broker.config import RUN_REGISTRY_ENV
from hermes_gateway.cli.common import fail, failing, note, settings_of, sync_tools


def _listen(host: str, port: int, home: Any) -> Any:
    """The listening socket of ``serve``; a taken port is a one-line error naming who holds it."""
    import socket

    from workers import runfiles

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror}")
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        holders = [x.describe() for x in runfiles.entries(home) if x.port == port and x.is_ours()]
        if holders:
            hint = f" (by {holders[0]}); `hermes-gateway stop --all` stops it, or pick another --port"
        else:  # stop --all finds the processes of one HERMES_HOME: say which one was looked in
            run = runfiles.run_dir(home)
            hint = (
                f"; no gateway process of HERMES_HOME {run.parent} holds it (looked in {run}): pick another "
                "--port, or if it is the serve of another home, stop it with `hermes-gateway --home THAT_HOME stop --all`"
            )
        fail(f"cannot listen on {host}:{port}: {e.strerror}{hint}")
    sock.listen(2048)
    return sock


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", default=8787, show_default=True, type=click.IntRange(1, 65535),
    help="Port of the API and the console.",
)
@click.option("--token", help="Admin bearer token every /v1 route and /mcp want (default $HERMES_API_TOKEN).")
@click.option(
    "--mcp-stateful", is_flag=True,
    help="Keep MCP sessions at /mcp (handshake-era clients then get tools/list_changed; a proxy must be sticky).",
)
@click.pass_context
def serve(ctx: click.Context, host: str, port: int, token: str | None, mcp_stateful: bool) -> None:
    """The HTTP/SSE API, MCP at /mcp and the web console (GET / in a browser); see hermes_gateway/http_api.py."""
    import signal

    import uvicorn

    from hermes_gateway.credentials import Credentials
    from hermes_gateway.http_api import TOKEN_ENV, create_app
    from hermes_gateway.local import local_stack

    settings = settings_of(ctx)
    token = token or settings.api.token
    with failing():
        credentials = Credentials.from_settings(settings, token)
    if not credentials.required and host not in ("127.0.0.1", "localhost", "::1"):
        fail(
            f"listening on {host} lets anyone there register tools and run calls: give --token (or ${TOKEN_ENV}, "
            "or api.tokens in config.yaml)"
        )
    from hermes_gateway.http_limits import uvicorn_options
    from hermes_gateway.local import watch_control_stop
    from workers import runfiles

    sock = _listen(host, port, settings.home)  # before the broker and worker: a taken port fails at once
    # uvicorn shuts down on SIGTERM, then raises the signal again to the handler it found: exit through
    # our own cleanup (stop the local worker, the embedded broker) instead of dying on the spot. A SIGTERM
    # while the broker and worker start is kept and obeyed once they are up; while cleaning up, ignored.
    early: list[int] = []
    signal.signal(signal.SIGTERM, lambda sig, _frame: early.append(sig))
    # In this machine's run registry ($HERMES_HOME/run) with its embedded broker and local worker, so
    # `stop --all` stops them all (this process first; it stops its worker and broker itself).
    runfiles.enable(settings.home)
    # Written, not read: its local worker records itself too (it stops with serve: parents go first).
    os.environ[RUN_REGISTRY_ENV] = "1"
    runfile = runfiles.register("serve", host=host, port=port)
    try:
        with failing(), local_stack(settings) as (gw, procs):
            try:
                signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))
                if early:
                    sys.exit(0)
                runfiles.register("serve", host=host, port=port, url=gw.broker.url)
                # `stop --all` sent to the broker (from any host) stops this server too, as it does workers.
                watch_control_stop(gw.conn, lambda: os.kill(os.getpid(), signal.SIGTERM))
                sync_tools(gw)  # $HERMES_HOME/tools, as every command that runs calls does
                local = f" (with {len(procs)} local worker)" if procs else ""
                note(f"broker: {gw.description}{local}")
                note(f"console and API on http://{host}:{port}/, MCP on http://{host}:{port}/mcp")
                app = create_app(gw, credentials=credentials, mcp_stateful=mcp_stateful)
                config = uvicorn.Config(
                    app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                    **uvicorn_options(settings.api),
                )
                uvicorn.Server(config).run(sockets=[sock])
            finally:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        runfiles.unregister(runfile)
