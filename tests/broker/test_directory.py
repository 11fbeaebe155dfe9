"""The tool directory: versioned registration shared through Redis (spec files: tests/workers/test_specs.py)."""

from __future__ import annotations

from typing import Any

import pytest

from broker import keys
from broker.directory import Directory
from broker.errors import UnknownTool
from broker.toolspec import ToolSpec

ECHO = {"name": "echo", "executor": "python", "function": "workers.executors.builtin:echo", "timeout": 5}


def spec(**over: Any) -> ToolSpec:
    return ToolSpec.from_dict({**ECHO, **over})


def test_register_then_fetch_returns_the_spec_and_its_version(fake: Any) -> None:
    d = Directory(fake)
    assert d.register(spec()) == (1, True)
    entry = d.fetch("echo")
    assert entry is not None
    assert entry.version == 1
    assert entry.spec == ToolSpec.from_dict(ECHO)
    assert entry.spec.config == {"function": "workers.executors.builtin:echo"}


def test_registering_an_identical_spec_changes_nothing(fake: Any) -> None:
    d = Directory(fake)
    d.register(spec())
    ps = fake.pubsub()
    ps.subscribe(keys.TOOLS_CHANNEL)
    ps.get_message(timeout=0.01)
    assert d.register(spec()) == (1, False)
    assert d.register(ToolSpec.from_stored(dict(ECHO))) == (1, False)
    assert ps.get_message(timeout=0.01) is None
    assert int(fake.get(keys.TOOLS_VERSION)) == 1


def test_a_changed_spec_gets_a_new_version_and_a_notice(fake: Any) -> None:
    d = Directory(fake)
    d.register(spec())
    d.register(spec(name="other"))
    ps = fake.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(keys.TOOLS_CHANNEL)
    ps.get_message(timeout=0.01)
    assert d.register(spec(timeout=9)) == (3, True)
    msg = ps.get_message(timeout=0.1)
    assert msg is not None and msg["data"] == b"echo"
    assert d.fetch("echo").spec.timeout == 9


def test_get_serves_from_cache_only_when_new_enough(fake: Any) -> None:
    d, other = Directory(fake), Directory(fake)
    d.register(spec())
    assert d.get("echo").spec.timeout == 5
    v2, _ = other.register(spec(timeout=7))
    assert d.get("echo").spec.timeout == 5  # cached, and nobody asked for newer
    assert d.get("echo", min_version=v2).spec.timeout == 7
    other.register(spec(timeout=8))
    d.invalidate("echo")
    assert d.get("echo").spec.timeout == 8


def test_an_unknown_or_removed_tool_is_unknown_tool(fake: Any) -> None:
    d = Directory(fake)
    with pytest.raises(UnknownTool) as info:
        d.get("nope")
    assert info.value.details == {"tool": "nope"}
    d.register(spec())
    d.get("echo")
    assert d.remove("echo") is True
    assert d.remove("echo") is False
    with pytest.raises(UnknownTool):
        d.get("echo")
    assert d.fetch("echo") is None


def test_all_lists_every_entry_sorted(fake: Any) -> None:
    d = Directory(fake)
    for name in ("zeta", "alpha", "mid"):
        d.register(spec(name=name))
    assert [(e.spec.name, e.version) for e in d.all()] == [("alpha", 2), ("mid", 3), ("zeta", 1)]


def test_removing_a_tool_forgets_its_breaker_and_no_other(fake: Any) -> None:
    d = Directory(fake)
    d.register(spec())
    for key in ("tool:echo", "shared:backend"):
        fake.sadd(keys.BREAKERS, key)
        fake.hset(keys.breaker(key), mapping={"state": "open", "opened_at": 1})
    assert d.remove("echo") is True
    assert fake.smembers(keys.BREAKERS) == {b"shared:backend"}  # (a key other tools may share stays)
    assert not fake.exists(keys.breaker("tool:echo")) and fake.exists(keys.breaker("shared:backend"))


def test_a_spec_this_process_registers_is_what_its_next_lookup_gets(fake: Any) -> None:
    """Before its own change notice comes back over pub/sub (a busy event thread: the next call ran the
    spec before, which ``tests/e2e/test_directory_e2e.py`` caught under load)."""
    d = Directory(fake)
    d.register(spec(description="first"))
    assert d.get("echo").spec.description == "first"  # (cached)
    version, changed = d.register(spec(description="second"))
    entry = d.get("echo")
    assert changed and entry.version == version and entry.spec.description == "second"
