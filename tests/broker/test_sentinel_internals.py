"""One test per redis-py inside that broker/sentinel.py's following connections override, so an upgrade of
redis-py that changes one fails here instead of leaving a client knocking on a dead primary after a
failover. redis is pinned (pyproject.toml) to the range these cover; tests/e2e/test_sentinel.py proves the
failover itself on real Sentinels."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import redis
import redis.asyncio.connection
import redis.asyncio.sentinel
import redis.connection
import redis.sentinel


class _Counting(redis.connection.Connection):
    reconnects = 0

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        type(self).reconnects += 1
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)


def test_a_sync_connection_reconnects_through_connect_check_health_when_it_sends(conn: redis.Redis) -> None:
    kwargs = conn.connection_pool.connection_kwargs
    c = _Counting(host=kwargs["host"], port=kwargs["port"], db=kwargs.get("db", 0))
    try:
        assert not c.is_connected
        c.send_command("PING")  # (not connected yet: the send connects, as after a broken connection)
        assert c.read_response() in (b"PONG", "PONG", True)
        assert _Counting.reconnects >= 1 and c.is_connected
        c.disconnect()
        before = _Counting.reconnects
        c.send_command("PING")
        assert c.read_response() in (b"PONG", "PONG", True)
        assert _Counting.reconnects > before
    finally:
        c.disconnect()


def test_connect_check_health_takes_the_options_the_override_passes_on() -> None:
    for cls in (redis.connection.Connection, redis.asyncio.connection.Connection):
        params = inspect.signature(cls.connect_check_health).parameters
        assert list(params)[1:3] == ["check_health", "retry_socket_connect"], cls


def test_an_async_connection_reconnects_through_connect_check_health_when_it_sends() -> None:
    assert "connect_check_health" in inspect.getsource(
        redis.asyncio.connection.AbstractConnection.send_packed_command
    )
    assert inspect.iscoroutinefunction(redis.asyncio.connection.AbstractConnection.connect_check_health)


def test_a_sentinel_managed_connection_is_pointed_at_its_primary_through_connect_to() -> None:
    for cls in (redis.sentinel.SentinelManagedConnection, redis.asyncio.sentinel.SentinelManagedConnection):
        assert list(inspect.signature(cls.connect_to).parameters) == ["self", "address"], cls
    assert inspect.iscoroutinefunction(redis.asyncio.sentinel.SentinelManagedConnection.connect_to)
    assert "self.connect_to(" in inspect.getsource(redis.sentinel.SentinelManagedConnection)


def test_a_connection_says_whether_it_is_connected_and_its_pool_where_the_primary_is() -> None:
    for cls in (redis.connection.AbstractConnection, redis.asyncio.connection.AbstractConnection):
        assert isinstance(inspect.getattr_static(cls, "is_connected"), property), cls
    for pool in (redis.sentinel.SentinelConnectionPool, redis.asyncio.sentinel.SentinelConnectionPool):
        assert callable(pool.get_master_address), pool
        assert "self.is_master = " in inspect.getsource(pool.__init__), pool
    assert inspect.iscoroutinefunction(redis.asyncio.sentinel.SentinelConnectionPool.get_master_address)


def test_an_async_connection_is_not_connected_before_it_connects() -> None:
    async def check() -> Any:
        c = redis.asyncio.connection.Connection(host="127.0.0.1", port=1)
        return c.is_connected

    assert asyncio.run(check()) is False
