"""Spec validation with field paths (what every spec has; an executor's keys: tests/workers/test_specs.py), the
seed's unquoted body_template in config.yaml, and the directory shared by processes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import redis

from broker import keys
from broker.codec import unpack
from broker.config import load_settings
from broker.directory import Directory
from broker.errors import InvalidSpec
from broker.toolspec import ToolSpec

# The seed's line, verbatim (section 2.2 of tool-gateway-v0.10.zh.md).
SEED_BODY_TEMPLATE = "body_template: {query: {{city}}, opts: {unit: {{unit}}}}"
SEED_TEMPLATE_VALUE = {"query": "{{city}}", "opts": {"unit": "{{unit}}"}}

ECHO = {"name": "echo", "executor": "python", "function": "workers.executors.builtin:echo"}


def _error(data: dict[str, Any]) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        ToolSpec.from_dict(data)
    return info.value


# -- field paths -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "path", "expected"),
    [
        (
            {"input_schema": {"type": "object", "properties": {"city": {"type": "strin"}}}},
            "input_schema.properties.city.type",
            "JSON Schema type",
        ),
        ({"input_schema": {"type": "object", "required": "city"}}, "input_schema.required", "array"),
        (
            {"output_schema": {"type": "object", "properties": {"n": {"minimum": "zero"}}}},
            "output_schema.properties.n.minimum",
            "number",
        ),
        ({"input_schema": {"type": "string"}}, "input_schema.type", '"object"'),
        ({"retry": {"max": 3, "backof": 1}}, "retry.backof", "did you mean 'backoff'"),
        ({"retry": {"max": -1}}, "retry.max", "integer >= 0"),
        ({"retry": {"on": [1]}}, "retry.on", "error type"),
        ({"breaker": {"failures": 0}}, "breaker.failures", "integer >= 1"),
        ({"breaker": {"rate": 1.5}}, "breaker.rate", "0 < rate <= 1"),
        ({"breaker": {"key": ""}}, "breaker.key", "non-empty string"),
        ({"breaker": {"cooldwon": 3}}, "breaker.cooldwon", "known keys: failures, cooldown"),
    ],
)
def test_errors_name_the_field_path_and_what_was_expected(
    extra: dict[str, Any], path: str, expected: str
) -> None:
    e = _error({**ECHO, **extra})
    assert e.details == {"path": path}
    assert f"{path}: " in e.message
    assert expected in e.message


def test_valid_retry_breaker_and_schemas_are_accepted() -> None:
    spec = ToolSpec.from_dict(
        {
            **ECHO,
            "input_schema": {"type": "object", "properties": {"city": {"type": ["string", "null"]}}},
            "output_schema": {"type": "array", "items": {"$ref": "#/$defs/row"}, "$defs": {"row": {}}},
            "retry": {
                "max": 3,
                "backoff": 0.5,
                "max_backoff": 10,
                "jitter": True,
                "factor": 3,
                "on": ["executor_error"],
            },
            "breaker": {
                "failures": 5,
                "cooldown": 30,
                "rate": 0.5,
                "window": 60,
                "min_calls": 10,
                "key": "k",
                "on": ["tool_timeout"],
            },
        }
    )
    assert spec.retry is not None and spec.retry["factor"] == 3
    assert spec.breaker is not None and spec.breaker["on"] == ["tool_timeout"]


def test_mcp_server_shorthand_becomes_the_form_the_executor_reads() -> None:
    spec = ToolSpec.from_dict({"name": "t", "executor": "mcp", "server": "fs", "tool": "read"})
    assert spec.config == {"mcp": {"server": "fs"}, "tool": "read"}
    assert ToolSpec.from_dict(spec.to_dict()) == spec


# -- the seed's unquoted body_template -----------------------------------------------------------


def test_the_seeds_body_template_line_loads_from_config_yaml(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(
        f"executors:\n  http:\n    {SEED_BODY_TEMPLATE}\n", encoding="utf-8"
    )
    settings = load_settings(tmp_path)
    assert settings.executor_settings("http")["body_template"] == SEED_TEMPLATE_VALUE


# -- the directory ------------------------------------------------------------------------------


def test_put_without_replace_keeps_a_different_spec(fake: Any) -> None:
    d, echo, echo3 = Directory(fake), ToolSpec.from_dict(ECHO), ToolSpec.from_dict({**ECHO, "timeout": 3})
    assert d.put(echo) == (1, "added")
    assert d.put(echo3, replace=False) == (1, "kept")
    assert d.fetch("echo").spec.timeout == 30.0
    assert d.put(echo, replace=False) == (1, "unchanged")
    assert d.put(echo3) == (2, "updated")


def test_a_spec_whose_yaml_mapping_mixes_key_types_registers(fake: Any) -> None:
    # (YAML `headers: {1: a, b: c}`: keys of two types, which a plain sort cannot order)
    spec = ToolSpec.from_dict({**ECHO, "headers": {1: "a", "b": "c"}})
    assert spec.digest() == ToolSpec.from_dict({**ECHO, "headers": {"b": "c", 1: "a"}}).digest()
    assert Directory(fake).put(spec) == (1, "added")
    assert ToolSpec.from_dict(ECHO).digest() != spec.digest()


def test_a_fetch_that_raced_a_change_notice_is_not_cached(fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    d, other = Directory(fake), Directory(fake)
    other.register(ToolSpec.from_dict(ECHO))
    real_fetch = d.fetch

    def slow_fetch(name: str) -> Any:
        entry = real_fetch(name)  # reads version 1 ...
        other.register(ToolSpec.from_dict({**ECHO, "timeout": 9}))  # ... while version 2 lands
        d.invalidate(name)  # and its notice arrives before the reader stores what it read
        return entry

    monkeypatch.setattr(d, "fetch", slow_fetch)
    assert d.get("echo").version == 1
    monkeypatch.setattr(d, "fetch", real_fetch)
    assert d.get("echo").spec.timeout == 9  # not the stale version 1 from the cache


def _register_loop(index: int, url: str, spec: dict[str, Any], times: int, start: Any, out: Any) -> None:
    d = Directory(redis.Redis.from_url(url))
    start.wait(10)
    out.put((index, [d.put(ToolSpec.from_dict(spec)) for _ in range(times)]))


def _race(url: str, specs: list[dict[str, Any]], times: int) -> list[list[tuple[int, str]]]:
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_register_loop, args=(i, url, s, times, start, out)) for i, s in enumerate(specs)
    ]
    for p in procs:
        p.start()
    start.set()
    results = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    return [results[i] for i in range(len(specs))]  # in the order of ``specs``


def _stored(conn: redis.Redis, name: str) -> tuple[ToolSpec, str, int]:
    raw = conn.hget(keys.TOOLS, name)
    digest = conn.hget(keys.TOOLS + ":digest", name).decode()
    ver = int(conn.hget(keys.TOOLS + ":ver", name))
    return ToolSpec.from_stored(unpack(raw)), digest, ver


def test_two_processes_registering_the_same_spec_make_one_version(redis_url: str, conn: redis.Redis) -> None:
    results = _race(redis_url, [ECHO, ECHO], times=50)
    outcomes = [o for r in results for o in r]
    assert {v for v, _ in outcomes} == {1}
    assert sorted(o for _, o in outcomes).count("added") == 1
    assert int(conn.get(keys.TOOLS_VERSION)) == 1


def test_two_processes_with_different_specs_get_distinct_versions_and_the_last_writer_wins(
    redis_url: str, conn: redis.Redis
) -> None:
    a, b = {**ECHO, "timeout": 1}, {**ECHO, "timeout": 2}
    results = _race(redis_url, [a, b], times=1)
    (va, _), (vb, _) = results[0][0], results[1][0]
    assert {va, vb} == {1, 2}
    spec, digest, ver = _stored(conn, "echo")
    assert ver == 2
    winner = a if va == 2 else b
    assert spec == ToolSpec.from_dict(winner)
    assert digest == spec.digest()


def test_many_interleaved_updates_leave_no_torn_entry(redis_url: str, conn: redis.Redis) -> None:
    a, b = {**ECHO, "timeout": 1}, {**ECHO, "timeout": 2, "description": "b"}
    results = _race(redis_url, [a, b], times=100)
    versions = [v for r in results for v, o in r if o != "unchanged"]
    assert len(versions) == len(set(versions))  # every change got its own version
    spec, digest, ver = _stored(conn, "echo")
    assert ver == max(v for r in results for v, _ in r) == int(conn.get(keys.TOOLS_VERSION))
    assert digest == spec.digest()  # the spec, its digest and its version were written together
    last = a if any(v == ver for v, _ in results[0]) else b
    assert spec == ToolSpec.from_dict(last)
