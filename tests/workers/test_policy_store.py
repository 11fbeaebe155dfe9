"""The active policy in Redis: versioned pushes with a notice, clear, and a worker core that follows them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker import keys
from broker.config import Settings
from broker.errors import DecodeError
from workers import policy_store
from workers.policy import STRICT, Policy
from workers.runner import WorkerCore

STRICT_POLICY = Policy.from_dict({"mode": "strict", "principals": {"a": {"grants": ["x"]}}})


def notices(fake: Any) -> Any:
    ps = fake.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(keys.channel(fake, keys.POLICY_CHANNEL))
    return ps


def received(ps: Any) -> list[bytes]:
    """Every notice delivered so far (the subscribe confirmation reads as None, so read a few times)."""
    out = []
    for _ in range(20):
        msg = ps.get_message(timeout=0.01)
        if msg is not None:
            out.append(msg["data"])
    return out


def test_push_stores_a_new_version_and_publishes_it_but_an_identical_push_changes_nothing(fake: Any) -> None:
    ps = notices(fake)
    assert policy_store.load(fake) == policy_store.Stored(None, 0)
    assert policy_store.push(fake, STRICT_POLICY, source="/etc/hermes/config.yaml") == (1, True)
    assert policy_store.push(fake, STRICT_POLICY) == (1, False)
    assert policy_store.push(fake, Policy()) == (2, True)
    assert received(ps) == [b"1", b"2"]
    stored = policy_store.load(fake)
    assert stored.policy == Policy() and stored.version == 2 and stored.pushed_at > 0


def test_clear_drops_the_policy_keeps_counting_and_tells_the_workers(fake: Any) -> None:
    policy_store.push(fake, STRICT_POLICY, source="f")
    ps = notices(fake)
    assert policy_store.clear(fake) == 2
    assert policy_store.clear(fake) == 0  # nothing left to clear: no notice
    assert received(ps) == [b"2"]
    assert policy_store.load(fake).policy is None
    assert policy_store.active(fake, Policy()) == (Policy(), 2)
    assert policy_store.push(fake, STRICT_POLICY) == (3, True)  # newer than anything before


def test_garbage_in_redis_is_a_decode_error(fake: Any) -> None:
    fake.hset(keys.POLICY, mapping={"data": b"\x81\xa1x\x01", "version": 7})
    with pytest.raises(DecodeError):
        policy_store.load(fake)


@pytest.fixture
def core(fake: Any, tmp_path: Path) -> Any:
    c = WorkerCore(fake, Settings(home=tmp_path, policy={"mode": "permissive"}), "w-test")
    yield c
    c.close()


def test_a_core_uses_config_until_a_push_follows_pushes_and_falls_back_on_clear(fake: Any, core: Any) -> None:
    assert core.policy.mode == "permissive" and core.policy_version == 0
    policy_store.push(fake, STRICT_POLICY)
    assert core.refresh_policy() is True
    assert core.policy == STRICT_POLICY and core.policy_version == 1
    assert core.refresh_policy() is False  # same policy: nothing to do
    policy_store.clear(fake)
    assert core.refresh_policy() is True and core.policy.mode == "permissive" and core.policy_version == 2


def test_a_broken_push_keeps_the_policy_the_core_had(fake: Any, core: Any) -> None:
    policy_store.push(fake, STRICT_POLICY)
    core.refresh_policy()
    fake.hset(keys.POLICY, "data", b"not msgpack \xc1")
    assert core.refresh_policy() is False
    assert core.policy.mode == STRICT  # never silently back to a more permissive one


def test_a_core_started_after_a_push_judges_by_the_pushed_policy(fake: Any, tmp_path: Path) -> None:
    policy_store.push(fake, STRICT_POLICY)
    c = WorkerCore(fake, Settings(home=tmp_path), "w-late")
    try:
        assert c.policy == STRICT_POLICY and c.policy_version == 1
    finally:
        c.close()
