"""Registration refuses specs that could never run, naming the field path (review 17, D8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker.directory import Directory, load_spec_file, spec_from_yaml_text
from broker.errors import InvalidSpec
from broker.toolspec import ToolSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tools"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "opts": {"type": "object"}}}


def refused(data: dict[str, Any]) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        ToolSpec.from_dict({"name": "x", "description": "d", **data})
    return info.value


@pytest.mark.parametrize(
    ("data", "path", "words"),
    [
        (
            {"executor": "http", "endpoint": "not a url"},
            "endpoint",
            "expected an http(s) URL, got 'not a url'",
        ),
        ({"executor": "http", "endpoint": "ftp://example.com/x"}, "endpoint", "http(s) URL"),
        ({"executor": "http", "url": "example.com/x"}, "url", "http(s) URL"),
        ({"executor": "http", "endpoint": "http://{{host}}/x"}, "endpoint", "scheme or host"),
        (
            {"executor": "http", "endpoint": "http://h/x", "send_args_as": "xml"},
            "send_args_as",
            "query, form, json",
        ),
        ({"executor": "http", "endpoint": "http://h/x", "headers": ["a"]}, "headers", "mapping"),
        (
            {"executor": "http", "endpoint": "http://h/x", "headers": {"{{h}}": "v"}},
            "headers.{{h}}",
            "header names",
        ),
        (
            {"executor": "http", "endpoint": "http://h/x", "body_template": "{a: [1,"},
            "body_template",
            "not valid",
        ),
        (
            {"executor": "http", "endpoint": "http://h/x", "body_template": "{'{{k}}': 1}"},
            "body_template.{{k}}",
            "keys",
        ),
        (
            {"executor": "python", "function": "nocolon"},
            "function",
            "expected 'package.module:callable', got 'nocolon'",
        ),
        ({"executor": "python", "function": "mod:"}, "function", "package.module:callable"),
        ({"executor": "python", "function": "a b:c"}, "function", "package.module:callable"),
        ({"executor": "command", "command": "echo 'unclosed"}, "command", "cannot split"),
        ({"executor": "command", "command": "{{prog}} -x"}, "command", "argv[0]"),
        ({"executor": "command", "command": ["echo", {"a": 1}]}, "command[1]", "expected a string"),
        ({"executor": "command", "command": "echo", "env_set": ["A=1"]}, "env_set", "mapping"),
        ({"executor": "database", "query": "SELECT 1; DROP TABLE t"}, "query", "one statement"),
        ({"executor": "database", "query": "SELECT 1", "mode": "fancy"}, "mode", "template, structured"),
        ({"executor": "database", "mode": "structured", "tables": {"t": "a,b"}}, "tables.t", "column names"),
        ({"executor": "grpc", "method": "NoService"}, "method", "package.Service/Method"),
    ],
)
def test_a_spec_that_could_never_run_is_refused_at_registration(
    data: dict[str, Any], path: str, words: str
) -> None:
    err = refused(data)
    assert err.details["path"] == path
    assert f"tool 'x': {path}: " in str(err) and words in str(err)


@pytest.mark.parametrize(
    "data",
    [
        {"executor": "http", "endpoint": "https://api.example.com/v1/{{id}}?q={{q}}"},
        {"executor": "http", "endpoint": "${WEATHER_BASE}/search"},  # judged on the worker, once filled in
        {
            "executor": "http",
            "endpoint": "https://${API_HOST}/x",
            "headers": {"Authorization": "Bearer ${T}"},
        },
        {"executor": "python", "function": "workers.executors.builtin:echo"},
        {"executor": "python", "function": "workers.executors.builtin.echo"},
        {"executor": "python", "function": "${TOOL_FUNCTION}"},
        {"executor": "command", "command": "echo Hello, {{name}}!"},
        {"executor": "command", "command": ["echo", 1, 2.5]},
        {"executor": "database", "dsn": "${WEATHER_DB_DSN}", "query": "SELECT ';' AS x -- one; statement"},
        {"executor": "grpc", "target": "127.0.0.1:50051", "method": "pkg.Greeter/Greet"},
        {"executor": "grpc", "target": "127.0.0.1:50051", "method": "pkg.Greeter.Greet"},
        {
            "executor": "http",
            "endpoint": "http://h/x",
            "body_template": "{query: {{city}}, opts: {unit: {{unit}}}}",
        },
    ],
)
def test_specs_that_can_run_still_register(data: dict[str, Any]) -> None:
    spec = ToolSpec.from_dict({"name": "x", **data})
    assert (spec.name, spec.executor) == ("x", data["executor"])


def test_every_shipped_example_registers() -> None:
    paths = sorted(EXAMPLES.glob("*.yaml"))
    assert paths
    for path in paths:
        spec = load_spec_file(path)
        assert spec.name and spec.executor in ("http", "command", "mcp", "database", "grpc", "python"), path


# -- placeholders must name a declared property ----------------------------------------------------


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"executor": "command", "command": "echo {{zz}}"}, "command"),
        ({"executor": "command", "command": ["echo", "{{name}}", "--x={{zz}}"]}, "command[2]"),
        ({"executor": "command", "command": "echo", "env_set": {"A": "{{zz}}"}}, "env_set.A"),
        ({"executor": "http", "endpoint": "http://h/u/{{zz}}"}, "endpoint"),
        ({"executor": "http", "url": "http://h/u?q={{zz}}"}, "url"),
        ({"executor": "http", "endpoint": "http://h/", "headers": {"X-A": "k {{zz}}"}}, "headers.X-A"),
        ({"executor": "http", "endpoint": "http://h/", "body_template": "{q: {{zz}}}"}, "body_template"),
        (
            {"executor": "http", "endpoint": "http://h/", "body_template": {"q": ["{{zz}}"]}},
            "body_template.q[0]",
        ),
    ],
)
def test_a_placeholder_naming_no_declared_property_is_refused(data: dict[str, Any], path: str) -> None:
    err = refused({**data, "input_schema": SCHEMA})
    assert err.details["path"] == path
    assert "placeholder {{zz}} names no property of input_schema (declared: name, opts)" in str(err)


def test_the_reviewers_command_spec_from_yaml_is_refused() -> None:
    text = (
        "name: hello\nexecutor: command\ncommand: echo {{zz}}\n"
        "input_schema: {type: object, properties: {name: {type: string}}}\n"
    )
    with pytest.raises(InvalidSpec, match=r"command: placeholder \{\{zz\}\} names no property"):
        spec_from_yaml_text(text)


def test_placeholders_are_not_judged_when_the_schema_declares_no_properties() -> None:
    free = ToolSpec.from_dict({"name": "x", "executor": "command", "command": "echo {{anything}}"})
    assert free.config["command"] == "echo {{anything}}"
    patterned = ToolSpec.from_dict(
        {
            "name": "x",
            "executor": "command",
            "command": "echo {{anything}}",
            "input_schema": {"type": "object", "patternProperties": {"^a": {}}, "properties": {"b": {}}},
        }
    )
    assert patterned.config["command"] == "echo {{anything}}"


def test_dotted_placeholders_follow_declared_nested_properties() -> None:
    nested = {
        "type": "object",
        "properties": {"opts": {"type": "object", "properties": {"unit": {"type": "string"}}}, "free": {}},
    }
    ok = {"name": "x", "executor": "http", "endpoint": "http://h/", "input_schema": nested}
    ToolSpec.from_dict({**ok, "body_template": "{u: {{opts.unit}}, f: {{free.any.depth}}}"})
    with pytest.raises(InvalidSpec, match=r"\{\{opts\.nope\}\}"):
        ToolSpec.from_dict({**ok, "body_template": "{u: {{opts.nope}}}"})


def test_registration_through_the_directory_refuses_before_anything_is_stored(fake: Any) -> None:
    directory = Directory(fake)
    with pytest.raises(InvalidSpec, match="endpoint"):
        directory.register({"name": "x", "executor": "http", "endpoint": "ftp://example.com/x"})
    assert directory.all() == []


def test_a_stored_spec_is_read_back_without_the_new_checks() -> None:
    # A spec stored by an older version stays readable (and fails, typed, only when called).
    spec = ToolSpec.from_stored({"name": "old", "executor": "python", "function": "nocolon"})
    assert spec.config["function"] == "nocolon"
