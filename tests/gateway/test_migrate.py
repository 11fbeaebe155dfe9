"""Filling and reading the directory: v0.9 migration, ``mcp add``, ``tool list``, model-facing schemas."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from broker import keys
from broker.directory import Directory
from hermes_gateway.cli import main
from hermes_gateway.migrate import migrate, upgrade_spec
from workers.specs import check_spec, load_spec_dir

MCP_SERVER = Path(__file__).resolve().parents[1] / "workers" / "executors" / "mcp_server.py"

# A v0.9 home: one tools.json list (old key names) and per-file specs in tools/.
TOOLS_JSON = {
    "tools": [
        {
            "name": "get_weather",
            "description": "查询指定城市的实时天气情况",
            "type": "rest",
            "url": "http://127.0.0.1:8081/weather",
            "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "timeout_ms": 5000,
            "tags": ["read_only"],
        },
        {"name": "adder", "type": "py", "handler": "tests.workers.executors.pyfuncs:add", "retries": 2},
        {"name": "off", "type": "shell", "cmd": "echo off", "enabled": False},
        {"name": "broken", "type": "shell", "cmd": "echo", "schema": {"type": "object", "required": "x"}},
    ]
}
OLD_HELLO = "name: hello\ntype: shell\ncmd: echo Hello, {{name}}!\nparameters: {type: object, properties: {name: {type: string}}}\ntimeout_ms: 2500\n"
NEW_ECHO = "name: echo\nexecutor: python\nfunction: workers.executors.builtin:echo\n"


def _v09_home(home: Any) -> None:
    (home.path / "tools.json").write_text(json.dumps(TOOLS_JSON, ensure_ascii=False), encoding="utf-8")
    (home.tools_dir / "hello.yaml").write_text(OLD_HELLO, encoding="utf-8")
    (home.tools_dir / "lookup.json").write_text(
        json.dumps({"type": "sql", "sql": "SELECT 1 WHERE :x = :x", "timeout_ms": 800}), encoding="utf-8"
    )
    (home.tools_dir / "echo.yaml").write_text(NEW_ECHO, encoding="utf-8")


def test_upgrade_spec_renames_the_old_keys() -> None:
    new, notes = upgrade_spec(
        {"name": "x", "type": "shell", "cmd": "ls", "timeout_ms": 1500, "tags": "admin"}
    )
    assert new == {
        "name": "x",
        "executor": "command",
        "command": "ls",
        "timeout": 1.5,
        "permissions": ["admin"],
    }
    assert "type→executor" in notes and "executor shell→command" in notes and "timeout_ms→timeout" in notes


def test_migrate_imports_reports_why_and_a_second_run_changes_nothing(fake: Any, home: Any) -> None:
    _v09_home(home)
    d = Directory(fake)
    first = {o.name: o for o in migrate(d, home.path)}
    assert {n: o.status for n, o in first.items()} == {
        "get_weather": "imported",
        "adder": "imported",
        "off": "skipped",
        "broken": "skipped",
        "echo": "imported",
        "hello": "imported",
        "lookup": "imported",
    }
    assert first["off"].reason == "disabled in v0.9 (enabled: false)"
    assert first["broken"].reason.endswith(
        "input_schema.required: not valid JSON Schema 2020-12: 'x' is not of type 'array'"
    )
    assert "schema→input_schema" in first["get_weather"].reason
    weather = d.fetch("get_weather").spec
    assert (weather.executor, weather.timeout, weather.permissions) == ("http", 5.0, ("read_only",))
    assert d.fetch("adder").spec.retry == {"max": 2}
    assert d.fetch("hello").spec.config["command"] == "echo Hello, {{name}}!"

    # Old per-file specs were rewritten in the v0.10 shape (originals kept), so tool list can read tools/.
    assert sorted(p.name for p in home.tools_dir.iterdir()) == [
        "echo.yaml",
        "hello.yaml",
        "hello.yaml.v09.bak",
        "lookup.json.v09.bak",
        "lookup.yaml",
    ]
    assert {s.name for s in load_spec_dir(home.tools_dir)} == {"echo", "hello", "lookup"}

    counter = fake.get(keys.TOOLS_VERSION)
    second = migrate(d, home.path)
    assert {o.name: o.status for o in second if o.name not in ("off", "broken")} == dict.fromkeys(
        ["get_weather", "adder", "echo", "hello", "lookup"], "unchanged"
    )
    assert [o.reason for o in second if o.status == "skipped"] == [
        first["off"].reason,
        first["broken"].reason,
    ]
    assert fake.get(keys.TOOLS_VERSION) == counter


def test_migrate_keeps_a_different_directory_spec_unless_forced(fake: Any, home: Any) -> None:
    (home.tools_dir / "hello.yaml").write_text(OLD_HELLO, encoding="utf-8")
    d = Directory(fake)
    d.register(check_spec({"name": "hello", "executor": "command", "command": "echo newer"}))
    [o] = migrate(d, home.path, dry_run=True)
    assert (o.status, o.reason) == ("skipped", "differs from the directory's spec")
    [o] = migrate(d, home.path)
    assert o.status == "skipped" and "--force replaces it" in o.reason
    assert (home.tools_dir / "hello.yaml").read_text() == OLD_HELLO  # not rewritten: nothing was imported
    [o] = migrate(d, home.path, force=True)
    assert (o.status, o.version) == ("updated", 2)
    assert d.fetch("hello").spec.config["command"] == "echo Hello, {{name}}!"


def test_cli_migrate_twice_on_the_shared_broker(
    redis_url: str, home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    (home.path / "tools.yaml").write_text(
        yaml.safe_dump([{"name": "adder", "type": "py", "handler": "tests.workers.executors.pyfuncs:add"}]),
        encoding="utf-8",
    )
    (home.tools_dir / "hello.yaml").write_text(OLD_HELLO, encoding="utf-8")
    runner = CliRunner()
    first = runner.invoke(main, ["migrate"])
    assert first.exit_code == 0, first.output
    assert "imported   adder" in first.output and "1 imported" not in first.output
    assert first.output.strip().endswith("2 imported")
    second = runner.invoke(main, ["migrate", "--json"])
    assert second.exit_code == 0, second.output
    assert [(o["name"], o["status"]) for o in json.loads(second.output)] == [
        ("adder", "unchanged"),
        ("hello", "unchanged"),
    ]


def test_cli_migrate_imports_the_tools_of_a_v09_config_file_and_leaves_the_file_as_it_was(
    redis_url: str, home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v0.9 kept its tools in its config file (the seed's pitfall 7): a tools: list in config.yaml, a tools:
    mapping in config.json. Both are imported with the same renames; the files are not changed."""
    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    config = home.config({"logging": {"level": "INFO"}, "tools": [yaml.safe_load(OLD_HELLO)]})
    written = config.read_text(encoding="utf-8")
    adder = {"type": "py", "handler": "tests.workers.executors.pyfuncs:add", "retries": 1}
    (home.path / "config.json").write_text(json.dumps({"tools": {"adder": adder}}), encoding="utf-8")
    runner = CliRunner()
    empty = runner.invoke(main, ["tool", "list"])
    assert f"{config} holds v0.9 tool specs: run `hermes-gateway migrate`" in empty.output, empty.output
    first = runner.invoke(main, ["migrate"])
    assert first.exit_code == 0, first.output
    assert "config.yaml[0]" in first.output and "config.json[0]" in first.output
    assert first.output.strip().endswith("2 imported")
    d = Directory(__import__("redis").Redis.from_url(redis_url))
    hello = d.fetch("hello").spec
    assert (hello.executor, hello.timeout, hello.config["command"]) == ("command", 2.5, "echo Hello, {{name}}!")
    assert (d.fetch("adder").spec.executor, d.fetch("adder").spec.retry) == ("python", {"max": 1})
    assert config.read_text(encoding="utf-8") == written and not list(home.tools_dir.iterdir())
    second = runner.invoke(main, ["migrate", "--json"])
    assert [(o["name"], o["status"]) for o in json.loads(second.output)] == [
        ("hello", "unchanged"),
        ("adder", "unchanged"),
    ], second.output
    # Another program's tools: settings in a shared config.yaml are no specs: not read as tools, not failed.
    home.config({"tools": {"restrict_to_workspace": True, "settings": {"protected": ["x"]}, "names": ["web"]}})
    third = runner.invoke(main, ["migrate", "--json"])
    assert third.exit_code == 0 and [o["name"] for o in json.loads(third.output)] == ["adder"], third.output


def test_cli_migrate_twice_on_the_embedded_broker_and_the_empty_list_says_to_migrate(
    home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without HERMES_REDIS_URL the directory lasts one command: migrate writes tools/<name>.yaml (not
    counted again as found), and a second run finds every tool unchanged. Before it, `tool list` says why
    the list is empty (the seed's pitfall 7)."""
    monkeypatch.delenv("HERMES_REDIS_URL", raising=False)
    monkeypatch.setenv("HERMES_HOME", str(home.path))
    (home.path / "tools.yaml").write_text(
        yaml.safe_dump([{"name": "adder", "type": "py", "handler": "tests.workers.executors.pyfuncs:add"}]),
        encoding="utf-8",
    )
    runner = CliRunner()
    empty = runner.invoke(main, ["tool", "list"])
    assert empty.exit_code == 0 and "holds v0.9 tool specs: run `hermes-gateway migrate`" in empty.output
    first = runner.invoke(main, ["migrate", "--json"])
    assert first.exit_code == 0, first.output
    assert [(o["name"], o["status"]) for o in json.loads(first.output)] == [("adder", "imported")]
    assert (home.tools_dir / "adder.yaml").is_file()
    second = runner.invoke(main, ["migrate", "--json"])  # (tools.yaml's adder and the adder.yaml it made: one tool)
    assert [(o["name"], o["status"]) for o in json.loads(second.output)] == [("adder", "unchanged")], second.output
    listed = runner.invoke(main, ["tool", "list"])
    assert "adder" in listed.output and "v0.9" not in listed.output


def test_cli_migrate_exits_1_when_a_spec_could_not_be_migrated_and_keeps_the_rest(
    redis_url: str, home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    (home.path / "tools.yaml").write_text(
        yaml.safe_dump(
            [
                {"name": "adder", "type": "py", "handler": "tests.workers.executors.pyfuncs:add"},
                {"name": "odd", "type": "ftp"},
                {"name": "off", "type": "py", "handler": "x:y", "enabled": False},
            ]
        ),
        encoding="utf-8",
    )
    out = CliRunner().invoke(main, ["migrate"])
    assert out.exit_code == 1, out.output
    assert "imported   adder" in out.output and "1 spec(s) could not be migrated" in out.output
    as_json = CliRunner().invoke(main, ["migrate", "--json"])
    assert as_json.exit_code == 1
    rows = {o["name"]: o for o in json.loads(as_json.output)}
    assert rows["odd"]["failed"] is True and rows["off"]["failed"] is False  # disabled: skipped by choice


def test_tool_list_shows_limits_permissions_and_breaker_state(
    redis_url: str, home: Any, conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    home.config({"executors": {"python": {"concurrency": 7}}})
    echo = "workers.executors.builtin:echo"
    home.tool("echo", function=echo, timeout=10, permissions=["read_only"], queue_size=3)
    home.tool("noop", function=echo, breaker={"failures": 2, "cooldown": 5})
    home.tool("shared", function=echo, breaker={"key": "backend-a"})
    conn.hset(keys.breaker("tool:noop"), mapping={"state": "open", "opened_at": 1})
    result = CliRunner().invoke(main, ["tool", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows["echo"]["limits"] == {"concurrency": 7, "queue_size": 3, "timeout": 10.0}
    assert (rows["echo"]["permissions"], rows["echo"]["breaker_state"]) == (["read_only"], "off")  # none configured
    assert rows["noop"]["breaker_state"] == "open"
    assert rows["shared"]["breaker_state"] == "closed"
    conn.hset(keys.breaker("backend-a"), "state", "half_open")  # a breaker the spec names by its key
    rows = {r["name"]: r for r in json.loads(CliRunner().invoke(main, ["tool", "list", "--json"]).output)}
    assert rows["shared"]["breaker_state"] == "half_open"
    from rich.console import Console

    monkeypatch.setattr("hermes_gateway.views.console", Console(width=200))
    table = CliRunner().invoke(main, ["tool", "list"])
    assert table.exit_code == 0, table.output
    assert "breaker" in table.output and "open" in table.output and "half_open" in table.output and " off " in table.output


def test_tool_schemas_are_the_tools_each_principal_may_call(redis_url: str, home: Any) -> None:
    from hermes_gateway.client import Gateway

    home.config(
        {
            "policy": {
                "mode": "strict",
                "principals": {
                    "reader": {"grants": ["read_only"]},
                    "admin": {"grants": ["read_only", "write"]},
                },
            }
        }
    )
    gw = Gateway.connect(redis_url, home=str(home.path), embedded_ok=False)
    try:
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        gw.register_tool(
            {**_py("lookup"), "description": "Look up", "permissions": ["read_only"], "input_schema": schema}
        )
        gw.register_tool({**_py("drop"), "permissions": ["write"]})
        gw.register_tool(_py("undeclared"))  # strict mode: nobody may call it
        names = {p: [t["function"]["name"] for t in gw.tool_schemas(p)] for p in ("reader", "admin", None)}
        assert names == {"reader": ["lookup"], "admin": ["drop", "lookup"], None: []}
        [lookup] = gw.tool_schemas("reader")
        assert lookup == {
            "type": "function",
            "function": {"name": "lookup", "description": "Look up", "parameters": schema},
        }
        assert gw.tool_schemas("admin")[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    finally:
        gw.close()


# The stdio server imports the MCP SDK first: on a loaded machine (make test runs two xdist workers) its
# handshake can pass the default 10 s.
SLOW_OK = ["--timeout", "60"]


def _py(name: str) -> dict[str, Any]:
    return {"name": name, "executor": "python", "function": "workers.executors.builtin:echo"}


def test_mcp_add_imports_every_tool_of_a_real_server(
    redis_url: str, home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    command = f"{sys.executable} {MCP_SERVER} stdio"
    runner = CliRunner()
    first = runner.invoke(main, ["mcp", "add", "test", "--command", command, "--prefix", "t_", *SLOW_OK])
    assert first.exit_code == 0, first.output
    lines = [line.split() for line in first.output.splitlines()[:-1]]
    assert {(words[0], words[1]) for words in lines} >= {
        ("added", "t_greet"),
        ("added", "t_add"),
        ("added", "t_fail"),
    }
    assert first.output.splitlines()[-1].startswith("test: ")
    d = Directory(__import__("redis").Redis.from_url(redis_url))
    greet = d.fetch("t_greet").spec
    assert (greet.executor, greet.config["tool"]) == ("mcp", "greet")
    assert greet.config["mcp"]["command"][-2:] == [str(MCP_SERVER), "stdio"]
    assert greet.input_schema["properties"]["name"]["type"] == "string"
    # A server's dotted name is made one a model API accepts; the server is still asked for its own name.
    dotted = d.fetch("t_files_read").spec
    assert dotted.config["tool"] == "files.read"
    second = runner.invoke(main, ["mcp", "add", "test", "--command", command, "--prefix", "t_", *SLOW_OK])
    assert {line.split()[0] for line in second.output.splitlines()[:-1]} == {"unchanged"}
    bad = runner.invoke(
        main, ["mcp", "add", "nowhere", "--command", f"{sys.executable} -c pass", "--timeout", "3"]
    )
    assert bad.exit_code == 1 and "nowhere:" in bad.output


def test_mcp_add_refuses_to_replace_a_tool_of_another_origin_without_force(
    redis_url: str, home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    command = f"{sys.executable} {MCP_SERVER} stdio"
    d = Directory(__import__("redis").Redis.from_url(redis_url))
    d.register(check_spec(_py("t_greet")))  # a local tool in the shared directory
    home.echo_tool("t_add")  # and a spec file every command loads (it would put its own t_add back)
    runner = CliRunner()
    refused = runner.invoke(main, ["mcp", "add", "test", "--command", command, "--prefix", "t_", *SLOW_OK])
    assert refused.exit_code == 1, refused.output
    assert "a tool named 't_greet' exists (python, not from MCP server 'test')" in refused.output
    assert f"{home.tools_dir / 't_add.yaml'} defines a tool 't_add'" in refused.output
    assert "--force" in refused.output and "nothing imported" in refused.output
    assert d.fetch("t_greet").spec.executor == "python" and d.fetch("t_fail") is None  # nothing changed
    # The server's own tools again are not "another origin"; --force replaces the others.
    forced = runner.invoke(main, ["mcp", "add", "test", "--command", command, "--prefix", "t_", "--force", *SLOW_OK])
    assert forced.exit_code == 0, forced.output
    d.invalidate()
    assert d.fetch("t_greet").spec.executor == "mcp" and d.fetch("t_fail") is not None
    again = runner.invoke(main, ["mcp", "add", "test", "--command", command, "--prefix", "t_", *SLOW_OK])
    assert again.exit_code == 1 and "t_add" in again.output and "t_greet" not in again.output, again.output


def test_mcp_list_and_remove_work_by_server_and_leave_other_tools_alone(
    redis_url: str, home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    command = f"{sys.executable} {MCP_SERVER} stdio"
    runner = CliRunner()
    for label, prefix in (("alpha", "a_"), ("beta", "b_")):
        added = runner.invoke(main, ["mcp", "add", label, "--command", command, "--prefix", prefix, *SLOW_OK])
        assert added.exit_code == 0, added.output
    d = Directory(__import__("redis").Redis.from_url(redis_url))
    d.register(check_spec({"name": "a_manual", "executor": "mcp", "mcp": {"command": ["x"]}, "tool": "greet"}))

    listed = runner.invoke(main, ["mcp", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    by_server = json.loads(listed.output)
    assert set(by_server) == {"alpha", "beta"}
    assert "a_greet" in by_server["alpha"] and "b_greet" in by_server["beta"]
    assert "a_manual" not in by_server["alpha"], "a tool registered by hand belongs to no imported server"
    text = runner.invoke(main, ["mcp", "list"]).output
    assert f"alpha: {len(by_server['alpha'])} tools" in text and str(MCP_SERVER) in text

    removed = runner.invoke(main, ["mcp", "remove", "alpha"])
    assert removed.exit_code == 0, removed.output
    assert {line.split()[1] for line in removed.output.splitlines()[:-1]} == set(by_server["alpha"])
    names = {e.spec.name for e in d.all()}
    assert not names & set(by_server["alpha"])
    assert set(by_server["beta"]) <= names and "a_manual" in names

    again = runner.invoke(main, ["mcp", "remove", "alpha"])
    assert again.exit_code == 1 and "no tools were imported from an MCP server named 'alpha'" in again.output


def test_remove_server_deletes_the_spec_files_an_embedded_broker_syncs_from(fake: Any, tmp_path: Path) -> None:
    from hermes_gateway.mcp_import import remove_server

    d = Directory(fake)
    for name in ("s_one", "s_two"):
        d.register(check_spec({"name": name, "executor": "mcp", "mcp": {"command": ["x"]}, "tool": name, "mcp_server": "s"}))
        (tmp_path / f"{name}.yaml").write_text("name: " + name)
    (tmp_path / "keep.yaml").write_text("name: keep")
    assert sorted(remove_server(d, "s", write_dir=tmp_path)) == ["s_one", "s_two"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.yaml"]
    assert remove_server(d, "s", write_dir=tmp_path) == []
