"""Bounded HTTP (issue 24.5): idle, slow-header, slow-body and kept-alive connections to a real ``serve``
process are closed within a bounded time, oversized heads are refused, and a body nested 10,000 deep is a
400, not a 500. Real sockets on loopback, 50 connections at a time."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, wait_until
from tests.e2e.util import free_port, wait_http

pytestmark = pytest.mark.e2e

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
KEEP_ALIVE = 2.0
BOUND = 12.0  # every connection below must be closed by then (the deadlines are 2 s)
COUNT = 50


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``hermes-gateway serve`` as a process of its own, on the embedded broker, short deadlines."""
    home = tmp_path_factory.mktemp("limits-home")
    (home / "tools").mkdir()
    (home / "tools" / "echo.yaml").write_text(
        "name: echo\nexecutor: python\nfunction: workers.executors.builtin:echo\ntimeout: 10\n"
    )
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "HERMES_REDIS_URL"}
    env.update(
        HERMES_HOME=str(home),
        HERMES_API_HEADER_TIMEOUT=str(HEADER_TIMEOUT),
        HERMES_API_BODY_TIMEOUT=str(BODY_TIMEOUT),
        HERMES_API_KEEP_ALIVE=str(KEEP_ALIVE),
        HERMES_API_MAX_CONNECTIONS="400",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", "from hermes_gateway.cli import main; main()", "serve", "--port", str(port)],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, timeout=60)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _connect(addr: str) -> socket.socket:
    host, port = addr.split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _hold(socks: list[socket.socket], trickle: bytes | None, every: float = 0.5) -> list[float]:
    """Keep the sockets open (sending ``trickle`` every ``every`` seconds, when given) until the server
    closes each; returns when each was closed (seconds from now), or fails past BOUND."""
    start = time.monotonic()
    closed: dict[int, float] = {}
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    next_send = start
    try:
        while len(closed) < len(socks):
            now = time.monotonic()
            assert now - start < BOUND, f"{len(socks) - len(closed)} of {len(socks)} connections still open"
            if trickle is not None and now >= next_send:
                next_send = now + every
                for s in socks:
                    if s.fileno() not in closed:
                        try:
                            s.send(trickle)
                        except OSError:  # reset by the server: closed
                            closed[s.fileno()] = time.monotonic() - start
                            sel.unregister(s)
            for key, _ in sel.select(timeout=0.1):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # EOF (anything answered before it, a 408 say, is read on the way)
                    closed[s.fileno()] = time.monotonic() - start
                    sel.unregister(s)
    finally:
        sel.close()
        for s in socks:
            s.close()
    return list(closed.values())


def test_idle_connections_that_never_send_a_request_are_closed(served: str) -> None:
    socks = [_connect(served) for _ in range(COUNT)]
    times = _hold(socks, None)
    assert len(times) == COUNT and min(times) >= HEADER_TIMEOUT * 0.9
    print(f"\n{COUNT} idle connections closed after {min(times):.2f}-{max(times):.2f}s")


def test_slow_header_connections_are_closed(served: str) -> None:
    socks = [_connect(served) for _ in range(COUNT)]
    for s in socks:
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {served}\r\nX-Slow: ".encode())
    times = _hold(socks, b"a")  # one byte of the header every half second: never complete
    assert len(times) == COUNT
    print(f"\n{COUNT} slow-header connections closed after {min(times):.2f}-{max(times):.2f}s")


def test_slow_body_connections_get_408_and_are_closed(served: str) -> None:
    socks = [_connect(served) for _ in range(COUNT)]
    head = (
        f"POST /v1/tools/echo/calls HTTP/1.1\r\nHost: {served}\r\nContent-Type: application/json\r\n"
        "Content-Length: 100000\r\n\r\n{"
    )
    for s in socks:
        s.sendall(head.encode())
    answers: list[bytes] = []
    start = time.monotonic()
    for s in socks[:3]:  # read what a few of them were told (the rest is read and dropped by _hold)
        s.settimeout(BOUND)
        answer = b""
        while b"request_timeout" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        answers.append(answer)
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers
    assert all(b'"request_timeout"' in a for a in answers), answers
    times = _hold(socks, b" ")
    elapsed = time.monotonic() - start
    assert len(times) == COUNT
    print(f"\n{COUNT} slow-body connections answered 408 and closed within {elapsed:.2f}s")


def test_a_kept_alive_connection_left_idle_is_closed(served: str) -> None:
    socks = [_connect(served) for _ in range(COUNT)]
    for s in socks:
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {served}\r\n\r\n".encode())
    for s in socks:
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    times = _hold(socks, None)
    assert len(times) == COUNT
    print(f"\n{COUNT} kept-alive idle connections closed after {min(times):.2f}-{max(times):.2f}s")


def test_an_oversized_request_head_is_refused(served: str) -> None:
    s = _connect(served)
    try:
        # A head still incomplete past 64 KiB (h11's incomplete-event limit) is refused at once.
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {served}\r\nX-Big: {'a' * 100_000}".encode())
        s.settimeout(BOUND)
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    finally:
        s.close()


@pytest.mark.parametrize("depth", [10_000, 2_000, 900, 600, 101, 99])
def test_deeply_nested_bodies_are_client_errors_not_500(served: str, depth: int) -> None:
    body = '{"args": {"x": ' + "[" * depth + "]" * depth + '}, "wait": 10}'
    r = httpx.post(
        f"http://{served}/v1/tools/echo/calls",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    if depth > 100:  # past MAX_DEPTH: refused whole, the parser's (bad_request) or the submission's limit
        assert r.status_code == 400 and r.json()["error"]["type"] in ("bad_request", "invalid_args"), r.text[:300]
    else:
        assert r.status_code == 200 and r.json()["state"] == "done", r.text[:300]
    obj = '{"args": ' + '{"a": ' * depth + "1" + "}" * depth + ', "wait": 10}'
    r = httpx.post(
        f"http://{served}/v1/tools/echo/calls", content=obj, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert r.status_code == (400 if depth > 100 else 200), (r.status_code, r.text[:300])


def test_the_server_still_answers_after_all_that(served: str) -> None:
    r = httpx.post(f"http://{served}/v1/tools/echo/calls", json={"args": {"x": 1}, "wait": 20}, timeout=30)
    assert r.status_code == 200 and r.json()["result"] == {"x": 1}
    assert json.loads(httpx.get(f"http://{served}/healthz", timeout=10).text)["ok"] is True


def test_past_the_connection_limit_requests_get_503(tmp_path: Any) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "HERMES_REDIS_URL"}
    (tmp_path / "tools").mkdir()
    env.update(HERMES_HOME=str(tmp_path), HERMES_API_MAX_CONNECTIONS="10", HERMES_API_HEADER_TIMEOUT="30")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from hermes_gateway.cli import main; main()", "serve", "--port", str(port)],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, timeout=60)
        held = [_connect(f"127.0.0.1:{port}") for _ in range(12)]

        def health() -> int:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code

        wait_until(lambda: health() == 503, 10, interval=0.1, message="503 past the limit")
        for s in held:
            s.close()
        wait_until(lambda: health() == 200, 10, interval=0.1, message="200 once the connections close")
    finally:
        proc.terminate()
        proc.wait(30)
