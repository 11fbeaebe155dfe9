"""The guarded httpx transport speaks httpx: httpcore's errors come out as httpx's of the same kind, the
guard's own refusals as they are (it is built on the public API of httpx and httpcore only)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from broker.errors import DestinationBlocked
from workers.executors.netguard import GuardedTransport, GuardPolicy

OPEN = GuardPolicy(enabled=False)


@pytest.fixture
def silent() -> Iterator[int]:
    """A port that accepts connections (in its backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        yield s.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_connection_is_httpx_connect_error() -> None:
    with httpx.Client(transport=GuardedTransport(OPEN, verify=True)) as client:
        with pytest.raises(httpx.ConnectError, match="cannot connect to 127.0.0.1"):
            client.get(f"http://127.0.0.1:{closed_port()}/")


def test_a_silent_server_is_httpx_read_timeout(silent: int) -> None:
    with httpx.Client(transport=GuardedTransport(OPEN, verify=True), timeout=0.2) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.get(f"http://127.0.0.1:{silent}/")


def test_a_guard_refusal_is_not_rewrapped() -> None:
    with httpx.Client(transport=GuardedTransport(GuardPolicy(), verify=True)) as client:
        with pytest.raises(DestinationBlocked):
            client.get(f"http://127.0.0.1:{closed_port()}/")
