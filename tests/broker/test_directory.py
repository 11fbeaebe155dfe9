"""The tool directory: versioned registration shared through Redis, and spec files on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker import keys
from broker.directory import Directory, load_spec_dir, load_spec_file, sync_dir
from broker.errors import InvalidSpec, UnknownTool
from broker.toolspec import ToolSpec

ECHO = {"name": "echo", "executor": "python", "function": "workers.executors.builtin:echo", "timeout": 5}


def test_register_then_fetch_returns_the_spec_and_its_version(fake: Any) -> None:
    d = Directory(fake)
    assert d.register(ECHO) == (1, True)
    entry = d.fetch("echo")
    assert entry is not None
    assert entry.version == 1
    assert entry.spec == ToolSpec.from_dict(ECHO)
    assert entry.spec.config == {"function": "workers.executors.builtin:echo"}


def test_registering_an_identical_spec_changes_nothing(fake: Any) -> None:
    d = Directory(fake)
    d.register(ECHO)
    ps = fake.pubsub()
    ps.subscribe(keys.TOOLS_CHANNEL)
    ps.get_message(timeout=0.01)
    assert d.register(dict(ECHO)) == (1, False)
    assert d.register(ToolSpec.from_dict(ECHO)) == (1, False)
    assert ps.get_message(timeout=0.01) is None
    assert int(fake.get(keys.TOOLS_VERSION)) == 1


def test_a_changed_spec_gets_a_new_version_and_a_notice(fake: Any) -> None:
    d = Directory(fake)
    d.register(ECHO)
    d.register({**ECHO, "name": "other"})
    ps = fake.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(keys.TOOLS_CHANNEL)
    ps.get_message(timeout=0.01)
    assert d.register({**ECHO, "timeout": 9}) == (3, True)
    msg = ps.get_message(timeout=0.1)
    assert msg is not None and msg["data"] == b"echo"
    assert d.fetch("echo").spec.timeout == 9


def test_get_serves_from_cache_only_when_new_enough(fake: Any) -> None:
    d, other = Directory(fake), Directory(fake)
    d.register(ECHO)
    assert d.get("echo").spec.timeout == 5
    v2, _ = other.register({**ECHO, "timeout": 7})
    assert d.get("echo").spec.timeout == 5  # cached, and nobody asked for newer
    assert d.get("echo", min_version=v2).spec.timeout == 7
    other.register({**ECHO, "timeout": 8})
    d.invalidate("echo")
    assert d.get("echo").spec.timeout == 8


def test_an_unknown_or_removed_tool_is_unknown_tool(fake: Any) -> None:
    d = Directory(fake)
    with pytest.raises(UnknownTool) as info:
        d.get("nope")
    assert info.value.details == {"tool": "nope"}
    d.register(ECHO)
    d.get("echo")
    assert d.remove("echo") is True
    assert d.remove("echo") is False
    with pytest.raises(UnknownTool):
        d.get("echo")
    assert d.fetch("echo") is None


def test_all_lists_every_entry_sorted(fake: Any) -> None:
    d = Directory(fake)
    for name in ("zeta", "alpha", "mid"):
        d.register({**ECHO, "name": name})
    assert [(e.spec.name, e.version) for e in d.all()] == [("alpha", 2), ("mid", 3), ("zeta", 1)]


def test_a_bad_spec_is_refused_before_it_reaches_redis(fake: Any) -> None:
    d = Directory(fake)
    with pytest.raises(InvalidSpec):
        d.register({"name": "x", "executor": "telepathy"})
    assert fake.dbsize() == 0


def test_a_bad_spec_file_is_collected_and_the_others_still_register(tmp_path: Path, fake: Any) -> None:
    (tmp_path / "a.yaml").write_text("name: a\nexecutor: command\ncommand: echo hi\n")
    (tmp_path / "b.yaml").write_text("name: b\nexecutor: ftp\n")
    (tmp_path / "c.yaml").write_text("name: [unclosed\n")
    with pytest.raises(InvalidSpec, match="b.yaml.*tool executor not found: 'ftp'"):
        sync_dir(Directory(fake), tmp_path)  # without a collector the first bad file raises
    (tmp_path / "d.yaml").write_bytes(b"name: \xff\xfe\n")  # not UTF-8
    (tmp_path / "e.yaml").symlink_to(tmp_path / "gone.yaml")  # dangling
    (tmp_path / ".#a.yaml").symlink_to("user@host.1234")  # an editor's lock file: not a spec at all
    errors: list[InvalidSpec] = []
    assert sync_dir(Directory(fake), tmp_path, errors) == [("a", 1, True)]
    names = ["b.yaml", "c.yaml", "d.yaml", "e.yaml"]
    assert [str(tmp_path / f) in str(e) for e, f in zip(errors, names, strict=True)] == [True] * 4
    assert "not UTF-8" in str(errors[2]) and "cannot be read" in str(errors[3])


def test_spec_files_load_sorted_and_errors_name_the_file(tmp_path: Path, fake: Any) -> None:
    (tmp_path / "b.yaml").write_text("name: b\nexecutor: command\ncommand: echo hi\n")
    (tmp_path / "a.yml").write_text("name: a\nexecutor: python\nfunction: workers.executors.builtin:noop\n")
    (tmp_path / "notes.txt").write_text("not a spec")
    assert [s.name for s in load_spec_dir(tmp_path)] == ["a", "b"]
    assert sync_dir(Directory(fake), tmp_path) == [("a", 1, True), ("b", 2, True)]
    assert sync_dir(Directory(fake), tmp_path) == [("a", 1, False), ("b", 2, False)]
    assert load_spec_dir(tmp_path / "missing") == []

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(InvalidSpec, match="bad.yaml"):
        load_spec_file(bad)
    bad.write_text("name: x\nexecutor: python\ntimeout: -1\n")
    with pytest.raises(InvalidSpec, match="bad.yaml.*timeout") as info:
        load_spec_file(bad)
    assert info.value.details == {"path": "timeout"}


def test_the_example_specs_load(fake: Any) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples" / "tools"
    names = {name for name, _, _ in sync_dir(Directory(fake), examples)}
    assert {"hello", "echo_args"} <= names


@pytest.mark.parametrize("name", ["../evil", "a/b", "has space", "x" * 65, "files.read", "名字"])
def test_a_tool_name_a_model_api_would_refuse_is_refused_at_registration(name: str) -> None:
    from broker.errors import InvalidSpec
    from broker.toolspec import ToolSpec

    with pytest.raises(InvalidSpec, match="1-64 letters, digits") as info:
        ToolSpec.from_dict({"name": name, "executor": "python", "function": "m:f"})
    assert info.value.details.get("path") == "name" or "spec.name" in str(info.value)
