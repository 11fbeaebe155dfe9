"""Submitting: an unreachable broker is a typed BrokerUnavailable in both clients (never a raw redis
error), and arguments over the size limit are refused at once, before anything is stored (issue 24.6)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker import keys
from broker.config import DEFAULT_MAX_ARGS, load_settings
from broker.errors import BrokerUnavailable, InvalidArgs
from hermes_gateway.aio import AsyncGateway
from hermes_gateway.client import Gateway
from tests.e2e.util import free_port


class OwnRedis:
    """A redis-server of the test's own, to stop as an outage (stopped by its pid)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port).ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path)
    yield server
    server.stop()


def test_submitting_during_an_outage_raises_broker_unavailable(own_redis: OwnRedis, home: Any) -> None:
    home.echo_tool()
    gw = Gateway.connect(own_redis.url, home=str(home.path), embedded_ok=False)
    try:
        gw.sync_tools()
        gw.tool("echo")  # cached: the outage is met by the submission itself
        own_redis.stop()
        with pytest.raises(BrokerUnavailable, match="submitting a call of 'echo'"):
            gw.call_tool("echo", {"x": 1})
        with pytest.raises(BrokerUnavailable):
            gw.map("echo", [{"x": 1}, {"x": 2}])
        with pytest.raises(BrokerUnavailable):
            gw.call_llm({"messages": [{"role": "user", "content": "hi"}]})
        gw.directory.invalidate()
        with pytest.raises(BrokerUnavailable):  # the directory read fails first
            gw.call_tool("echo", {"x": 1})
    finally:
        gw.close()


def test_submitting_during_an_outage_raises_broker_unavailable_async(own_redis: OwnRedis, home: Any) -> None:
    home.echo_tool()
    with Gateway.connect(own_redis.url, home=str(home.path), embedded_ok=False) as gw:
        gw.sync_tools()

    async def main() -> None:
        agw = await AsyncGateway.connect(own_redis.url, home=str(home.path), embedded_ok=False)
        try:
            await agw.tool("echo")
            own_redis.stop()
            with pytest.raises(BrokerUnavailable, match="submitting a call of 'echo'"):
                await agw.call_tool("echo", {"x": 1})
            with pytest.raises(BrokerUnavailable):
                await agw.map("echo", [{"x": 1}])
            with pytest.raises(BrokerUnavailable):
                await agw.call_llm({"messages": [{"role": "user", "content": "hi"}]})
            agw.invalidate("echo")
            with pytest.raises(BrokerUnavailable):
                await agw.call_tool("echo", {"x": 1})
        finally:
            await agw.close()

    asyncio.run(main())


def test_cancelling_during_an_outage_raises_broker_unavailable_in_both_clients(own_redis: OwnRedis, home: Any) -> None:
    """``cancel`` let the raw redis ConnectionError through, where a submission raises the typed error."""
    gw = Gateway.connect(own_redis.url, home=str(home.path), embedded_ok=False)

    async def cancel() -> None:
        agw = await AsyncGateway.connect(own_redis.url, home=str(home.path), embedded_ok=False)
        try:
            own_redis.stop()  # (both clients connected: the outage comes now)
            with pytest.raises(BrokerUnavailable, match=r"cancelling call \{tools\}.x"):
                await agw.cancel("{tools}.x")
        finally:
            await agw.close()

    try:
        asyncio.run(cancel())
        with pytest.raises(BrokerUnavailable, match=r"cancelling call \{tools\}.x"):
            gw.cancel("{tools}.x")
    finally:
        gw.close()


def test_arguments_over_the_limit_are_refused_before_anything_is_stored(
    gateway: Any, home: Any, conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_settings(home.path).broker.max_args == DEFAULT_MAX_ARGS == 32 * 1024 * 1024
    home.echo_tool()
    gateway.sync_tools()
    # The default: 33 MiB of arguments (the probe kept 20 MB for 24 h) is refused.
    with pytest.raises(InvalidArgs, match="over the limit") as info:
        gateway.call_tool("echo", {"blob": "x" * (33 * 1024 * 1024)})
    assert info.value.details["limit"] == DEFAULT_MAX_ARGS and info.value.type == "invalid_args"
    with pytest.raises(InvalidArgs, match="over the limit"):
        gateway.call_llm({"messages": [{"role": "user", "content": "x" * (33 * 1024 * 1024)}]})
    assert conn.keys(keys.job("*")) == []  # nothing was stored

    # A setting lowers it, for both clients.
    monkeypatch.setenv("HERMES_MAX_ARGS", "1000")
    small = Gateway.connect(gateway.broker.url, home=str(home.path), embedded_ok=False, check_workers=False)
    try:
        with pytest.raises(InvalidArgs) as info:
            small.call_tool("echo", {"blob": "x" * 2000})
        assert info.value.details == {"size": info.value.details["size"], "limit": 1000}
        batch = None
        with pytest.raises(InvalidArgs):
            batch = small.map("echo", [{"blob": "x"}, {"blob": "x" * 2000}])
        assert batch is None
    finally:
        small.close()

    async def main() -> None:
        agw = await AsyncGateway.connect(gateway.broker.url, home=str(home.path), embedded_ok=False)
        try:
            with pytest.raises(InvalidArgs, match="over the limit"):
                await agw.call_tool("echo", {"blob": "x" * 2000})
        finally:
            await agw.close()

    asyncio.run(main())
    assert conn.keys(keys.job("*")) == []
    small_ok = Gateway.connect(gateway.broker.url, home=str(home.path), embedded_ok=False, check_workers=False)
    try:
        assert small_ok.call_tool("echo", {"blob": "x" * 100}).call_id  # under the limit: accepted
    finally:
        small_ok.close()


def test_a_bad_max_args_setting_is_a_config_error(home: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from broker.errors import ConfigError

    monkeypatch.setenv("HERMES_MAX_ARGS", "lots")
    with pytest.raises(ConfigError, match="HERMES_MAX_ARGS"):
        load_settings(home.path)
    monkeypatch.setenv("HERMES_MAX_ARGS", "0")
    with pytest.raises(ConfigError, match="max_args"):
        load_settings(home.path)


def test_arguments_nested_past_the_limit_are_refused_at_submission(gateway: Any, home: Any, conn: redis.Redis) -> None:
    from hermes_gateway.clientcore import MAX_DEPTH

    home.echo_tool()
    gateway.sync_tools()
    deep: Any = 1
    for _ in range(MAX_DEPTH):
        deep = {"a": deep}
    with pytest.raises(InvalidArgs, match="nested more than"):
        gateway.call_tool("echo", {"x": deep})  # MAX_DEPTH + 1 levels with the arguments' own
    listed: Any = []
    for _ in range(5000):
        listed = [listed]
    with pytest.raises(InvalidArgs, match="nested more than"):
        gateway.call_tool("echo", {"x": listed})
    assert conn.keys(keys.job("*")) == []
    assert gateway.call_tool("echo", deep["a"]).call_id  # MAX_DEPTH levels: accepted
