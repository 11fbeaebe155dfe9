"""The client's side of fair dispatch: config.yaml's weights, batch share and per-key bound reach SUBMIT,
for both clients, and the call's class picks its waiting set (real Redis, no worker: calls wait)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from broker import keys
from broker.calls import UNIT
from broker.errors import QueueFull
from hermes_gateway.aio import AsyncGateway
from hermes_gateway.client import Gateway

TAG, CKEY = "{tools}", "tool:slow"


def tags(conn: redis.Redis, key: str) -> list[int]:
    return [int(score) for _, score in conn.zrange(key, 0, -1, withscores=True)]


def test_weights_class_and_per_key_bound_from_config_reach_the_broker(redis_url: str, home: Any, conn: redis.Redis) -> None:
    home.sleep_tool("slow", concurrency=1)
    home.config({"fairness": {"weights": {"alice": 4}, "batch_share": 0.25, "queue_size_per_key": 3}})
    with Gateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False) as gw:
        gw.sync_tools()
        gw.call_tool("slow", {"seconds": 1})  # takes the one slot
        gw.map("slow", [{"seconds": 1}] * 3, fairness_key="alice")
        gw.call_tool("slow", {"seconds": 1}, fairness_key="bob", call_class="batch")
        with pytest.raises(QueueFull) as err:
            gw.call_tool("slow", {"seconds": 1}, fairness_key="alice")
    assert err.value.details["fairness_key"] == "alice" and err.value.details["limit"] == 3
    alice = tags(conn, keys.waiting(TAG, CKEY))
    assert [b - a for a, b in zip(alice, alice[1:], strict=False)] == [UNIT // 4] * 2  # weight 4: a quarter step
    assert len(tags(conn, keys.waiting_batch(TAG, CKEY))) == 1  # bob's batch call waits apart
    assert conn.hget(keys.fair(TAG, CKEY), "sh") == b"2500"


def test_the_async_client_sends_the_same(redis_url: str, home: Any, conn: redis.Redis) -> None:
    home.sleep_tool("slow", concurrency=1)
    home.config({"fairness": {"queue_size_per_key": 1}})

    with Gateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False) as sync:
        sync.sync_tools()

    async def go() -> None:
        gw = await AsyncGateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False)
        try:
            await gw.call_tool("slow", {"seconds": 1})
            await gw.call_tool("slow", {"seconds": 1}, fairness_key="carol", call_class="batch")
            with pytest.raises(QueueFull):
                await gw.call_tool("slow", {"seconds": 1}, fairness_key="carol", call_class="batch")
        finally:
            await gw.close()

    asyncio.run(go())
    assert conn.zcard(keys.waiting_batch(TAG, CKEY)) == 1
