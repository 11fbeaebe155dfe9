"""Registration (workers/specs.py with each executor's ``check``) refuses specs that could never run, naming the
field path (review 17, D8); spec files and YAML text; the seed's unquoted body_template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.directory import Directory
from broker.errors import InvalidSpec
from broker.toolspec import ToolSpec
from tests.conftest import REPO
from workers.executors import EXECUTORS
from workers.specs import check_spec, load_spec_dir, load_spec_file, spec_from_yaml_text, sync_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tools"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "opts": {"type": "object"}}}
ECHO = {"name": "echo", "executor": "python", "function": "workers.executors.builtin:echo"}
# The seed's line, verbatim (section 2.2 of tool-gateway-v0.10.zh.md).
SEED_BODY_TEMPLATE = "body_template: {query: {{city}}, opts: {unit: {{unit}}}}"
SEED_TEMPLATE_VALUE = {"query": "{{city}}", "opts": {"unit": "{{unit}}"}}


def refused(data: dict[str, Any]) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        check_spec({"name": "x", "description": "d", **data})
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
    spec = check_spec({"name": "x", **data})
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
    free = check_spec({"name": "x", "executor": "command", "command": "echo {{anything}}"})
    assert free.config["command"] == "echo {{anything}}"
    patterned = check_spec(
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
    check_spec({**ok, "body_template": "{u: {{opts.unit}}, f: {{free.any.depth}}}"})
    with pytest.raises(InvalidSpec, match=r"\{\{opts\.nope\}\}"):
        check_spec({**ok, "body_template": "{u: {{opts.nope}}}"})


def test_registration_refuses_before_anything_is_stored(fake: Any, tmp_path: Path) -> None:
    directory = Directory(fake)
    (tmp_path / "x.yaml").write_text("name: x\nexecutor: http\nendpoint: ftp://example.com/x\n")
    with pytest.raises(InvalidSpec, match="endpoint"):
        sync_dir(directory, tmp_path)
    assert directory.all() == []


def test_a_stored_spec_is_read_back_without_the_new_checks() -> None:
    # A spec stored by an older version stays readable (and fails, typed, only when called).
    spec = ToolSpec.from_stored({"name": "old", "executor": "python", "function": "nocolon"})
    assert spec.config["function"] == "nocolon"


# -- an executor's keys -------------------------------------------------------------------------------


def _error(data: dict[str, Any]) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        check_spec(data)
    return info.value


def test_an_unknown_key_for_the_executor_is_named_with_the_known_ones() -> None:
    e = _error({"name": "w", "executor": "http", "endpiont": "http://x/"})
    assert e.details == {"path": "endpiont"}
    assert "unknown key for a http tool (did you mean 'endpoint'?)" in e.message
    assert "known keys: allow_hosts, allow_networks, body_template" in e.message
    # A key that belongs to another executor is unknown here too.
    e = _error({**ECHO, "command": "echo hi"})
    assert e.details == {"path": "command"}
    assert "function" in e.message


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"executor": "command"}, "command"),
        ({"executor": "http", "method": "POST"}, "endpoint"),
        ({"executor": "python"}, "function"),
        ({"executor": "database", "dsn": "sqlite://"}, "query"),
        ({"executor": "database", "mode": "structured"}, "tables"),
        ({"executor": "grpc", "target": "127.0.0.1:1"}, "method"),
        ({"executor": "mcp", "tool": "x"}, "mcp"),
    ],
)
def test_each_executor_names_its_missing_required_key(spec: dict[str, Any], path: str) -> None:
    e = _error({"name": "t", **spec})
    assert e.details == {"path": path}
    assert f"required for a {spec['executor']} tool" in e.message


MINIMAL = [
    {"executor": "command", "command": "echo hi"},
    {"executor": "http", "url": "http://127.0.0.1/"},
    {"executor": "python", "function": "pkg.mod:fn"},
    {"executor": "database", "query": "SELECT 1"},
    {"executor": "database", "mode": "structured", "tables": {"t": ["a"]}},
    {"executor": "grpc", "method": "pkg.Svc/M"},
    {"executor": "mcp", "mcp": {"command": ["srv"]}},
]


def test_each_executor_accepts_its_minimal_spec() -> None:
    for m in MINIMAL:
        assert check_spec({"name": "t", **m}).executor == m["executor"]
    assert sorted({m["executor"] for m in MINIMAL}) == sorted(EXECUTORS)  # every kind of the one table


def test_registering_a_spec_of_each_kind_loads_no_library_only_its_run_needs() -> None:
    code = (
        "import json, sys\nfrom workers.specs import check_spec\n"
        f"for m in {MINIMAL!r}:\n    check_spec({{'name': 't', **m}})\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    heavy = ("mcp", "grpc", "google.protobuf", "sqlalchemy", "psycopg", "httpx", "httpcore")
    assert [m for m in json.loads(out.stdout) if m.startswith(tuple(f"{h}." for h in heavy)) or m in heavy] == []


def test_stored_specs_are_read_back_without_the_strict_checks() -> None:
    old = {"name": "legacy", "executor": "command", "command": "echo", "note": "written by an older version"}
    with pytest.raises(InvalidSpec):
        check_spec(old)
    assert ToolSpec.from_stored(old).config == {"command": "echo", "note": "written by an older version"}


def test_the_seeds_body_template_line_loads_from_a_spec_file(tmp_path: Path) -> None:
    path = tmp_path / "search.yaml"
    path.write_text(
        "name: search_weather\nexecutor: http\nmethod: POST\nendpoint: http://127.0.0.1:8081/search\n"
        f"{SEED_BODY_TEMPLATE}\n",
        encoding="utf-8",
    )
    spec = load_spec_file(path)
    assert spec.config["body_template"] == SEED_TEMPLATE_VALUE


def test_placeholders_elsewhere_keep_their_text(tmp_path: Path) -> None:
    path = tmp_path / "hello.yaml"
    path.write_text(
        "name: hello\nexecutor: command\ncommand: echo Hello, {{name}}!\n"
        "env_set: {GREETING: {{ greeting }}, FIXED: '{{x}} y'}\n",
        encoding="utf-8",
    )
    spec = load_spec_file(path)
    assert spec.config["command"] == "echo Hello, {{name}}!"
    assert spec.config["env_set"] == {"GREETING": "{{ greeting }}", "FIXED": "{{x}} y"}


def test_an_old_spec_file_points_at_migrate(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("name: old\ntype: shell\ncmd: echo hi\ntimeout_ms: 5000\n", encoding="utf-8")
    with pytest.raises(InvalidSpec, match="old.yaml.*hermes-gateway migrate"):
        load_spec_file(path)


# -- spec files -----------------------------------------------------------------------------------


def test_a_bad_spec_is_refused_before_it_reaches_redis(fake: Any) -> None:
    d = Directory(fake)
    with pytest.raises(InvalidSpec, match="tool executor not found: 'telepathy'"):
        d.register(check_spec({"name": "x", "executor": "telepathy"}))
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
    with pytest.raises(InvalidSpec, match="1-64 letters, digits") as info:
        check_spec({"name": name, "executor": "python", "function": "m:f"})
    assert info.value.details.get("path") == "name" or "spec.name" in str(info.value)
