"""``redis+sentinel://`` broker URLs: what is read from them, what a message shows of them, what is refused;
and ``broker.wait_replicas`` / ``broker.wait_timeout_ms`` in the settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import load_settings
from broker.connection import from_url, redact_url
from broker.durability import shortfall
from broker.errors import BrokerNotDurable, BrokerUnavailable, ConfigError
from broker.sentinel import parse_sentinel_url
from tests.e2e.util import free_port


def test_one_sentinel_with_the_master_name_and_defaults() -> None:
    parsed = parse_sentinel_url("redis+sentinel://s1:26380/mymaster")
    assert parsed.sentinels == (("s1", 26380),)
    assert parsed.master == "mymaster"
    assert parsed.db == 0
    assert parsed.username is None and parsed.password is None and parsed.sentinel_password is None


def test_several_sentinels_a_db_both_passwords_and_a_default_port() -> None:
    parsed = parse_sentinel_url(
        "redis+sentinel://app:p%40ss@10.0.0.1:26379,s2,[::1]:26381/my%20master/3?sentinel_password=s%26cret"
    )
    assert parsed.sentinels == (("10.0.0.1", 26379), ("s2", 26379), ("::1", 26381))
    assert parsed.master == "my master" and parsed.db == 3
    assert (parsed.username, parsed.password) == ("app", "p@ss")
    assert parsed.sentinel_password == "s&cret"
    assert "p@ss" not in repr(parsed) and "s&cret" not in repr(parsed)


def test_a_password_without_a_user_and_a_trailing_slash() -> None:
    parsed = parse_sentinel_url("redis+sentinel://:pw@h:1/m/")
    assert (parsed.username, parsed.password, parsed.master, parsed.db) == (None, "pw", "m", 0)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h:1", "no master name"),
        ("redis+sentinel://h:1/", "no master name"),
        ("redis+sentinel:///m", "expected host:port"),
        ("redis+sentinel://h:1,,h2:2/m", "expected host:port"),
        ("redis+sentinel://h:port/m", "the port is not a number"),
        ("redis+sentinel://h:0/m", "expected host:port"),
        ("redis+sentinel://h:1/m/x", "database 'x' is not a number"),
        ("redis+sentinel://h:1/m/1/2", "expected /<master-name>[/db]"),
        ("redis+sentinel://:pw@h:1/m?sentinel_pasword=oops", "unknown option(s) sentinel_pasword"),
    ],
)
def test_malformed_urls_are_a_config_error_naming_the_masked_url(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_sentinel_url(url)
    assert says in str(info.value)
    assert "pw" not in str(info.value).replace("sentinel_pasword", "")
    assert redact_url(url) in str(info.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "redis+sentinel://u:pw@a:1,b:2/mymaster/3?sentinel_password=spw",
            "redis+sentinel://u:***@a:1,b:2/mymaster/3?sentinel_password=***",
        ),
        ("redis+sentinel://:pw@a:1/m?sentinel_password=spw&x=1", "redis+sentinel://:***@a:1/m?sentinel_password=***&x=1"),
        ("redis+sentinel://a:1/m?sentinel_password=spw", "redis+sentinel://a:1/m?sentinel_password=***"),
        ("redis+sentinel://a:1?sentinel_password=spw", "redis+sentinel://a:1?sentinel_password=***"),
        ("unix:///tmp/r.sock?db=1&password=pw", "unix:///tmp/r.sock?db=1&password=***"),
        ("redis://h:1/0?password=pw", "redis://h:1/0?password=***"),
    ],
)
def test_both_passwords_are_masked(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_unreachable_sentinels_are_one_line_naming_each_and_no_password() -> None:
    ports = [free_port(), free_port()]
    url = f"redis+sentinel://:s3cret@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/mymaster?sentinel_password=t0ps3cret"
    with pytest.raises(BrokerUnavailable) as info:
        from_url(url)
    message = str(info.value)
    assert "\n" not in message and "s3cret" not in message and "t0ps3cret" not in message
    assert message.startswith(f"no primary at {redact_url(url)}: ")
    for port in ports:
        assert f"127.0.0.1:{port} did not answer" in message


def _settings(tmp_path: Path, text: str) -> object:
    (tmp_path / "config.yaml").write_text(text)
    return load_settings(tmp_path)


def test_wait_replicas_and_its_timeout_come_from_config_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HERMES_WAIT_REPLICAS", raising=False)
    monkeypatch.delenv("HERMES_WAIT_TIMEOUT_MS", raising=False)
    settings = _settings(tmp_path, "broker: {}\n")
    assert (settings.broker.wait_replicas, settings.broker.wait_timeout_ms) == (0, 500)
    settings = _settings(tmp_path, "broker:\n  wait_replicas: 2\n  wait_timeout_ms: 250\n")
    assert (settings.broker.wait_replicas, settings.broker.wait_timeout_ms) == (2, 250)
    monkeypatch.setenv("HERMES_WAIT_REPLICAS", "1")
    assert load_settings(tmp_path).broker.wait_replicas == 1


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("broker:\n  wait_replicas: -1\n", "broker.wait_replicas"),
        ("broker:\n  wait_replicas: 1.5\n", "broker.wait_replicas"),
        ("broker:\n  wait_replicas: many\n", "broker.wait_replicas"),
        ("broker:\n  wait_timeout_ms: 0\n", "broker.wait_timeout_ms"),
    ],
)
def test_bad_wait_settings_are_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, says: str
) -> None:
    monkeypatch.delenv("HERMES_WAIT_REPLICAS", raising=False)
    monkeypatch.delenv("HERMES_WAIT_TIMEOUT_MS", raising=False)
    with pytest.raises(ConfigError, match=says):
        _settings(tmp_path, text)


def test_a_short_wait_is_broker_not_durable_with_what_was_confirmed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERMES_WAIT_REPLICAS", "2")
    monkeypatch.delenv("HERMES_WAIT_TIMEOUT_MS", raising=False)
    settings = load_settings(tmp_path)
    assert shortfall(2, settings, "call c1") is None and shortfall(3, settings, "call c1") is None
    error = shortfall(1, settings, "call c1", call_id="c1")
    assert isinstance(error, BrokerNotDurable)
    assert error.details == {"replicas": 1, "wanted": 2, "call_id": "c1"}
    assert "1 of 2 replica(s) within 500 ms" in str(error)
    assert error.to_wire()["type"] == "broker_not_durable"


def test_a_workers_confirmer_backs_off_after_a_short_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from broker.durability import Confirmer

    monkeypatch.setenv("HERMES_WAIT_REPLICAS", "1")
    confirmer = Confirmer(load_settings(tmp_path))
    assert confirmer.wanted()
    assert confirmer.check(1, "claims") is None and confirmer.wanted()
    assert isinstance(confirmer.check(0, "claims"), BrokerNotDurable)
    assert not confirmer.wanted()  # no WAIT for a while: no replica answers
    monkeypatch.setattr(time, "monotonic", lambda: float("inf"))
    assert confirmer.wanted()
    monkeypatch.setenv("HERMES_WAIT_REPLICAS", "0")
    assert not Confirmer(load_settings(tmp_path)).wanted()
