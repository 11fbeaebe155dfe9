"""``broker.connection.subscriber``: pub/sub for every kind of client redis-py can build."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
import redis.asyncio
from redis._parsers import _RESP2Parser

from broker.connection import subscriber


def _first_message(ps: Any) -> Any:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        msg = ps.get_message(timeout=0.2)
        if msg is not None:
            return msg
    return None


@pytest.mark.parametrize(
    "options",
    [{}, {"protocol": 2}, {"protocol": 3}, {"protocol": 2, "parser_class": _RESP2Parser}],
    ids=["default", "resp2", "resp3", "resp2-pure-python-parser"],
)
def test_messages_arrive_as_is_whatever_the_protocol_and_parser(redis_url: str, options: dict[str, Any]) -> None:
    conn = redis.Redis.from_url(redis_url, **options)
    ps = subscriber(conn)
    ps.subscribe("hermes:test:sub")
    conn.publish("hermes:test:sub", b"\x81\xa1k\xa1v")
    msg = _first_message(ps)
    assert msg is not None and msg["type"] == "message" and msg["data"] == b"\x81\xa1k\xa1v"
    ps.close()
    conn.close()


def test_an_asyncio_client_of_any_class_gets_an_async_handler(redis_url: str) -> None:
    class Instrumented(redis.asyncio.Redis):  # a wrapper defined outside redis.asyncio
        pass

    async def main() -> Any:
        conn = Instrumented.from_url(redis_url)
        ps = subscriber(conn)
        await ps.subscribe("hermes:test:async")
        await conn.publish("hermes:test:async", b"hi")
        try:
            for _ in range(20):
                msg = await ps.get_message(timeout=0.2)
                if msg is not None:
                    return msg["data"]
            return None
        finally:
            await ps.aclose()
            await conn.aclose()

    assert asyncio.run(main()) == b"hi"
