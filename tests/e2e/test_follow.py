"""A late subscriber on another connection gets a running call's history, then its live tail."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

from broker import events, keys
from tests.e2e.served import ADMIN, api, serve_processes
from tests.e2e.util import current

pytestmark = pytest.mark.e2e


def test_a_late_follower_gets_history_then_the_live_tail_once_each(
    gateway: Any, home: Any, workers: Any, redis_url: str, wait_until: Any
) -> None:
    home.sleep_tool()
    gateway.sync_tools()
    workers(1, concurrency=2)
    h = gateway.call_tool("sleep", {"seconds": 0.5})
    other = redis.Redis.from_url(redis_url)
    try:
        wait_until(
            lambda: current(other, [h.call_id])[h.call_id] == "executing", 5, message="the call to run"
        )
        seen = list(events.follow(other, h.call_id, timeout=10))
    finally:
        other.close()
    assert [(e.seq, e.state) for e in seen] == list(
        enumerate(["pending", "routing", "executing", "formatting", "done"], start=1)
    )
    assert seen[-1].detail["result"] == {"slept": 0.5}
    assert h.result(timeout=5) == {"slept": 0.5}


serve = pytest.fixture(serve_processes)
BURST = 300  # progress events the tool sends at once, right before it ends


def _burst_call(gateway: Any, home: Any) -> Any:
    """A call of a tool that sends BURST progress events and ends, submitted while no worker runs (the
    follower is on it before the burst)."""
    home.tool("chatty", function="tests.e2e.mcptools:chatty", timeout=20)
    gateway.sync_tools()
    return gateway.call_tool("chatty", {"n": BURST})


def _every_event(seqs: list[int], types: list[str]) -> None:
    missed = sorted(set(range(1, seqs[-1])) - set(seqs))
    assert seqs == list(range(1, len(seqs) + 1)), f"{len(missed)} events missed, from {missed[:1]}"
    assert types.count("progress") == BURST and types[-1] == "transition"


def test_serve_streams_every_event_of_a_call_another_client_submitted(
    gateway: Any, home: Any, workers: Any, serve: Any
) -> None:
    h = _burst_call(gateway, home)
    seqs: list[int] = []
    types: list[str] = []
    with api(serve(), ADMIN) as http, http.stream("GET", f"/v1/calls/{h.call_id}/events") as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("id:"):
                seqs.append(int(line.removeprefix("id:")))
            elif line.startswith("event:"):
                types.append(line.removeprefix("event:").strip())
                if len(types) == 1:  # (the stream follows the call: now it may run)
                    workers(1)
    _every_event(seqs, types)
    assert h.result(timeout=10) == {"chunks": BURST}


def test_another_clients_handle_follows_every_event_of_a_call(
    gateway: Any, home: Any, workers: Any, redis_url: str, wait_until: Any
) -> None:
    from hermes_gateway.client import Gateway

    h = _burst_call(gateway, home)
    channel = gateway.conn.hget(keys.job(h.call_id), keys.F_CHANNEL)
    seen: list[Any] = []
    with Gateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False) as other:
        follower = threading.Thread(target=lambda: seen.extend(other.handle(h.call_id).events(timeout=30)))
        follower.start()
        wait_until(lambda: gateway.conn.pubsub_numsub(channel)[0][1] == 2, message="the follower to subscribe")
        workers(1)
        follower.join(30)
    _every_event([e.seq for e in seen], [e.type for e in seen])
