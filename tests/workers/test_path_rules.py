"""Path rules judge every path-like string (issue 24.2): nested (``{{opts.path}}``), not conventionally
named (``filePath``), declared ``format: path``, or filling a command's argv, not only top-level
conventional names."""

from __future__ import annotations

from typing import Any

import pytest

from broker.toolspec import ToolSpec
from workers.pathargs import path_like
from workers.policy import Policy
from workers.specs import check_spec

ALLOW = ["/srv/data"]


def rule(tool: str, allow: Any = None) -> Policy:
    return Policy.from_dict({"args": {"path_prefixes": {tool: allow if allow is not None else ALLOW}}})


def tool(name: str, executor: str = "python", **fields: Any) -> ToolSpec:
    extra: dict[str, Any] = {"function": "workers.executors.builtin:echo"} if executor == "python" else {}
    return check_spec({"name": name, "executor": executor, **extra, **fields})


def allowed(p: Policy, spec: ToolSpec, args: dict[str, Any]) -> bool:
    return p.check("anyone", spec, args).allowed


def test_a_nested_placeholder_in_a_command_is_judged() -> None:
    # The probe's case: `cat {{opts.path}}` read /etc/hostname.
    spec = tool(
        "cat_opts",
        "command",
        command="cat {{opts.path}}",
        input_schema={"type": "object", "properties": {"opts": {"type": "object"}}},
    )
    p = rule("cat_opts")
    assert not allowed(p, spec, {"opts": {"path": "/etc/hostname"}})
    assert not allowed(p, spec, {"opts": {"path": "/srv/data/../../etc/hostname"}})
    assert allowed(p, spec, {"opts": {"path": "/srv/data/a.txt"}})


def test_a_camel_case_name_is_judged() -> None:
    # The probe's case: `filePath` read /etc/hostname.
    spec = tool("read_camel")
    p = rule("read_camel")
    d = p.check("anyone", spec, {"filePath": "/etc/hostname"})
    assert not d.allowed and "filePath" in d.message and d.rule == "args.path_prefixes.read_camel"
    assert allowed(p, spec, {"filePath": "/srv/data/x"})


@pytest.mark.parametrize(
    "name",
    ["path", "file", "filename", "file_name", "fileName", "filePath", "FILE_PATH", "outputFile", "log-dir",
     "logDir", "srcPath", "targetDirectory", "cwd", "dest", "src", "paths", "files", "input_file", "folder"],
)
def test_path_like_names(name: str) -> None:
    assert path_like(name)
    spec = tool("t")
    assert not allowed(rule("t"), spec, {name: "/etc/passwd"})
    assert not allowed(rule("t"), spec, {"outer": {"inner": [{name: "/etc/passwd"}]}})  # at any depth


@pytest.mark.parametrize("name", ["profile", "query", "pattern", "mode", "destination_country", "sources", "title"])
def test_names_that_only_look_alike_are_not_paths(name: str) -> None:
    assert not path_like(name)
    assert allowed(rule("t"), tool("t"), {name: "/etc/passwd"})


def test_lists_of_paths_and_of_records_with_paths() -> None:
    spec, p = tool("t"), rule("t")
    assert not allowed(p, spec, {"files": ["/srv/data/a", "/etc/b"]})
    assert not allowed(p, spec, {"items": [{"path": "/srv/data/a"}, {"path": "/etc/b"}]})
    assert not allowed(p, spec, {"files": [{"path": "/etc/b"}]})
    assert allowed(p, spec, {"files": [{"path": "/srv/data/a", "size": 3}], "items": [{"path": "/srv/data/b"}]})


def test_a_schema_format_path_makes_any_name_path_like() -> None:
    spec = tool(
        "t",
        input_schema={
            "type": "object",
            "properties": {
                "target": {"type": "string", "format": "path"},
                "opts": {"type": "object", "properties": {"where": {"type": "string", "format": "file-path"}}},
                "many": {"type": "array", "items": {"type": "string", "format": "path"}},
            },
        },
    )
    p = rule("t")
    assert not allowed(p, spec, {"target": "/etc/passwd"})
    assert not allowed(p, spec, {"opts": {"where": "/etc/passwd"}})
    assert not allowed(p, spec, {"many": ["/srv/data/a", "/etc/passwd"]})
    assert allowed(p, spec, {"target": "/srv/data/x", "opts": {"where": "/srv/data/y"}, "many": ["/srv/data/z"]})


def test_every_string_filling_a_command_argv_is_judged() -> None:
    spec = tool("show", "command", command=["cat", "--", "{{thing}}", "-n{{count}}"])
    p = rule("show")
    assert not allowed(p, spec, {"thing": "/etc/hostname", "count": 3})
    assert not allowed(p, spec, {"thing": "hostname", "count": 3})  # relative: resolved against a cwd unknown
    assert allowed(p, spec, {"thing": "/srv/data/x", "count": 3})  # a number is not a path


def test_an_env_set_variable_named_like_a_path_is_judged() -> None:
    spec = tool("run", "command", command="true", env_set={"CONFIG_FILE": "{{c}}", "GREETING": "{{g}}"})
    p = rule("run")
    assert not allowed(p, spec, {"c": "/etc/shadow", "g": "hi"})
    assert allowed(p, spec, {"c": "/srv/data/c.yaml", "g": "/not/a/path/but/a/greeting"})


def test_the_mapping_form_judges_exactly_the_named_args_dotted_ones_included() -> None:
    spec = tool("grep", "command", command="grep -- {{pattern}} {{opts.file}}")
    p = rule("grep", {"args": ["opts.file"], "allow": ALLOW})
    assert allowed(p, spec, {"pattern": "root", "opts": {"file": "/srv/data/log"}})
    assert not allowed(p, spec, {"pattern": "root", "opts": {"file": "/etc/passwd"}})
    # The list form judges every argv value, the pattern too: that is what the mapping form is for.
    assert not allowed(rule("grep"), spec, {"pattern": "root", "opts": {"file": "/srv/data/log"}})
