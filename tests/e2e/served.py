"""Helpers of the MCP-over-HTTP and principal tests: `hermes-gateway serve` as processes of their own,
the `mcp` SDK's streamable HTTP client with a token, and a directory with a policy and tokens."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import REPO, Home
from tests.e2e.util import free_port, wait_http

ADMIN = "admin-token-for-tests"
ALICE = "alice-token-for-tests"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TP = f"00-{TRACE}-00f067aa0ba902b7-01"
LOOKUP_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Serve:
    """``hermes-gateway serve`` as a process of its own, on a free loopback port."""

    def __init__(self, home: Home, redis_url: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        environ = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
        environ.update(HERMES_REDIS_URL=redis_url, HERMES_HOME=str(home.path), HERMES_API_TOKEN=ADMIN, **(env or {}))
        command = [sys.executable, "-c", "from hermes_gateway.cli import main; main()", "serve"]
        self.proc = subprocess.Popen(
            [*command, "--port", str(self.port), *args], cwd=REPO, env=environ, stderr=subprocess.PIPE, text=True
        )
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        wait_http(f"http://127.0.0.1:{self.port}/healthz", self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def serve_processes(home: Home, redis_url: str) -> Iterator[Any]:
    """The ``serve`` fixture: ``serve(*args)`` starts one more; all are stopped at teardown."""
    started: list[Serve] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Serve:
        started.append(Serve(home, redis_url, *args, env=env))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def client(url: str, token: str | None, **options: Any) -> Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    transport = streamable_http_client(url, http_client=httpx2.AsyncClient(headers=headers, timeout=60))
    return Client(transport, cache=None, **options)


def api(server: Any, token: str) -> httpx.Client:
    """An HTTP client of ``server`` (a ``serve_processes`` server) with ``token``."""
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.port}", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )


def configure(home: Home, **extra: Any) -> None:
    home.config(
        {
            "api": {"token_principal": "admin", "tokens": {sha(ALICE): {"principal": "alice"}}},
            "policy": {
                "mode": "strict",
                "principals": {"alice": {"grants": ["read_only"]}, "admin": {"grants": ["*"]}},
            },
            **extra,
        }
    )
    home.echo_tool("lookup", permissions=["read_only"], description="Look a thing up", input_schema=LOOKUP_SCHEMA)
    home.tool("steps", function="tests.e2e.mcptools:steps", timeout=20, permissions=["read_only"])
    home.sleep_tool(permissions=["read_only"])
    home.noop_tool("wipe", permissions=["admin"])
    home.sleep_tool("tight", concurrency=1, queue_size=0, permissions=["read_only"])
