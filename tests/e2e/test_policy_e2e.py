"""Policy on real workers: modes, grants and denials per principal, refusals that never run the tool,
the path a ``tool_request`` middleware rewrote, and a policy pushed to running workers."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner

from broker import events
from broker.errors import PermissionDenied
from hermes_gateway.cli import main
from middleware import enable_plugin
from tests.conftest import ECHO, Home, wait_until
from workers import policy_store

pytestmark = pytest.mark.e2e

PLUGIN = "policy-e2e-probe"
# A tool_request middleware that rewrites paths, and a post_tool_call hook that writes what it saw.
PLUGIN_CODE = """
import json, os

def register(ctx):
    ctx.register_middleware("tool_request", rewrite)
    ctx.register_hook("post_tool_call", seen)

def rewrite(**kw):
    path = kw["args"].get("path")
    if not isinstance(path, str):
        return None
    if path.startswith("~/"):
        new, why = "/srv/data/" + path[2:], "home paths live under /srv/data"
    elif path == "/srv/data/escape":
        new, why = "/etc/passwd", "a bad rewrite"
    else:
        return None
    return {"args": {**kw["args"], "path": new}, "source": "path-probe", "reason": why}

def seen(**kw):
    with open(os.environ["POST_HOOK_LOG"], "a") as f:
        f.write(json.dumps({k: kw.get(k) for k in ("tool_name", "status", "error_type", "args")}) + "\\n")
"""


@pytest.fixture
def ran(tmp_path: Path) -> Path:
    """The file the ``record`` tool appends one line to per run: proof of whether the executor ran."""
    return tmp_path / "ran.log"


@pytest.fixture
def hook_log(tmp_path: Path) -> Path:
    return tmp_path / "post_tool_call.jsonl"


def recorder(home: Home, ran: Path, name: str = "record", **fields: Any) -> None:
    """A command tool that appends its ``path`` to ``ran`` and prints it: no shell, a real process."""
    code = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n'); print(sys.argv[2])"
    home.tool(
        name,
        executor="command",
        command=[sys.executable, "-c", code, str(ran), "{{path}}"],
        input_schema={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        timeout=10,
        **fields,
    )


def runs(ran: Path) -> list[str]:
    return ran.read_text().splitlines() if ran.exists() else []


def install_plugin(home: Home) -> None:
    folder = home.path / "plugins" / PLUGIN
    folder.mkdir()
    (folder / "plugin.yaml").write_text(f"name: {PLUGIN}\nversion: '0.1'\nkind: standalone\n")
    (folder / "__init__.py").write_text(textwrap.dedent(PLUGIN_CODE))
    enable_plugin(home.path, PLUGIN)


def cli(redis_url: str, home: Home, *args: str) -> str:
    """Run ``hermes-gateway ARGS`` in this process, as a user would from a shell."""
    env = {"HERMES_REDIS_URL": redis_url, "HERMES_HOME": str(home.path)}
    try:
        out = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    finally:
        structlog.reset_defaults()  # the command configured logging onto the runner's stream
    assert out.exit_code == 0, out.output
    return out.output


def denied(handle: Any) -> PermissionDenied:
    with pytest.raises(PermissionDenied) as info:
        handle.result(20)
    return info.value


def test_permissive_and_strict_judge_the_same_directory_and_a_push_reaches_running_workers(
    home: Home, gateway: Any, workers: Any, conn: Any, redis_url: str
) -> None:
    home.noop_tool("open")  # declares no permissions
    home.noop_tool("free", permissions=[])  # declares it needs nothing
    home.noop_tool("read", permissions=["read_only"])
    home.config({"policy": {"mode": "permissive", "principals": {"reader": {"grants": ["read_only"]}}}})
    gateway.sync_tools()
    ws = workers(2)

    # Permissive: an undeclared tool is open to anyone; declared tags are still required.
    assert gateway.call_tool("open", {}).result(20) is None
    assert gateway.call_tool("free", {}).result(20) is None
    assert gateway.call_tool("read", {}, principal="reader").result(20) is None
    err = denied(gateway.call_tool("read", {}))
    assert err.details == {
        "tool": "read",
        "principal": "anonymous",
        "missing": ["read_only"],
        "rule": "permissions",
    }
    assert str(err).endswith("to allow it: grant read_only in a new entry policy.principals.anonymous: "
                             "{grants: [...]} (config.yaml), or call as a principal that holds them")

    # The same directory under strict, pushed to the running workers from an edited config.yaml.
    home.config({"policy": {"mode": "strict", "principals": {"reader": {"grants": ["read_only"]}}}})
    assert "policy version 1 pushed" in cli(redis_url, home, "policy", "push")
    wait_until(
        lambda: all(conn.hget(f"hermes:worker:{w.name}", "policy_version") == b"1" for w in ws),
        10,
        message="both workers on policy version 1",
    )
    assert all(w.alive for w in ws) and len(workers.started) == 2  # no restart
    for _ in range(4):  # several calls, so both workers judge one
        err = denied(gateway.call_tool("open", {}, principal="reader"))
        assert err.details["rule"] == "mode.strict" and err.details["tool"] == "open"
        assert str(err).startswith("permission denied: ")  # the seed's pitfall 3, in its words
        assert "; to allow it: declare `permissions: [tags]` in the spec of 'open'" in str(err)  # and the fix
    assert gateway.call_tool("free", {}).result(20) is None
    assert gateway.call_tool("read", {}, principal="reader").result(20) is None
    shown = cli(redis_url, home, "policy", "show")
    assert "active policy: version 1" in shown and "mode: strict" in shown
    assert "policy unchanged" in cli(redis_url, home, "policy", "push")

    # Pushing again is a new version; the workers follow without a restart.
    home.config({"policy": {"mode": "permissive"}})
    assert "policy version 2 pushed" in cli(redis_url, home, "policy", "push")
    wait_until(lambda: all(conn.hget(f"hermes:worker:{w.name}", "policy_version") == b"2" for w in ws), 10)
    assert gateway.call_tool("open", {}).result(20) is None


def test_grants_and_denials_per_principal(home: Home, gateway: Any, workers: Any, redis_url: str) -> None:
    for name, perms in {
        "read": ["read_only"],
        "write": ["write"],
        "admin": ["admin"],
        "shell": ["read_only"],
        "rm_rf": [],
    }.items():
        home.noop_tool(name, permissions=perms)
    home.noop_tool("db_drop_users")
    home.config(
        {
            "policy": {
                "mode": "strict",
                "deny_tools": ["rm_rf", "db_drop_*"],
                "principals": {
                    "agent-a": {"grants": ["read_only", "write"], "deny_tools": ["shell"]},
                    "ops-*": {"grants": ["*"]},
                    "*": {"grants": ["read_only"]},
                },
            }
        }
    )
    gateway.sync_tools()
    # Pushed, so this client (whose settings predate config.yaml) and the worker judge by one policy.
    cli(redis_url, home, "policy", "push")
    workers(1)
    ok, no = None, "denied"
    table = [
        ("agent-a", "read", ok, None),
        ("agent-a", "write", ok, None),
        ("agent-a", "admin", no, ("permissions", ["admin"])),
        ("agent-a", "shell", no, ("principals.agent-a.deny_tools", [])),
        ("agent-b", "read", ok, None),  # "*" grants read_only to everyone
        ("agent-b", "write", no, ("permissions", ["write"])),
        ("agent-b", "shell", ok, None),
        ("ops-1", "admin", ok, None),
        ("ops-1", "rm_rf", no, ("deny_tools", [])),  # global denials beat "*"
        ("ops-1", "db_drop_users", no, ("deny_tools", [])),
        (None, "read", ok, None),  # anonymous matches "*"
        (None, "admin", no, ("permissions", ["admin"])),
    ]
    handles = [
        gateway.call_tool(tool, {}, **({"principal": who} if who else {})) for who, tool, _, _ in table
    ]
    for (who, tool, outcome, why), h in zip(table, handles, strict=True):
        if outcome is ok:
            assert h.result(20) is None, (who, tool)
            continue
        err = denied(h)
        assert why is not None
        assert (err.details["rule"], err.details["missing"]) == why, (who, tool)
        assert err.details["principal"] == (who or "anonymous") and err.details["tool"] == tool
        assert tool in str(err)
    # What the model is offered is exactly what the worker lets through, per principal.
    for who in ("agent-a", "agent-b", "ops-1", None):
        offered = {t["function"]["name"] for t in gateway.tool_schemas(who)}
        allowed = {tool for w, tool, outcome, _ in table if w == who and outcome is ok}
        judged = {tool for w, tool, _, _ in table if w == who}
        assert offered & judged == allowed, who
    assert {t["function"]["name"] for t in gateway.tool_schemas("ops-1")} == {
        "read",
        "write",
        "admin",
        "shell",
    }


def test_a_refusal_never_runs_the_executor_reaches_post_tool_call_as_blocked_and_is_audited(
    home: Home, gateway: Any, workers: Any, conn: Any, ran: Path, hook_log: Path
) -> None:
    from broker.audit import AuditLog

    recorder(home, ran, permissions=["write"])
    home.config({"policy": {"principals": {"writer": {"grants": ["write"]}}}})
    install_plugin(home)
    gateway.sync_tools()
    workers(1, env={"POST_HOOK_LOG": str(hook_log)})

    refused = [gateway.call_tool("record", {"path": f"/tmp/r{i}"}, principal="reader") for i in range(5)]
    for h in refused:
        err = denied(h)
        assert err.details == {
            "tool": "record",
            "principal": "reader",
            "missing": ["write"],
            "rule": "permissions",
        }
    assert runs(ran) == []  # the executor never ran
    assert gateway.call_tool("record", {"path": "/tmp/ok"}, principal="writer").result(20) == "/tmp/ok"
    assert runs(ran) == ["/tmp/ok"]  # the recorder does record: the refusals above were real

    for h in refused:
        heard = [e.state for e in h.events(timeout=1) if e.type == events.TRANSITION]  # (as its caller heard)
        assert heard == ["pending", "routing", "failed"]  # never executing
    hooks = [json.loads(line) for line in hook_log.read_text().splitlines()]
    assert [(x["status"], x["error_type"]) for x in hooks] == [("blocked", "permission_denied")] * 5 + [
        ("ok", None)
    ]
    audit = AuditLog(conn)
    for h in refused:
        rec = audit.get(h.call_id)
        assert rec is not None and rec.state == "failed" and rec.error_type == "permission_denied"
        assert (
            rec.principal == "reader" and rec.tool_name == "record" and "write" in (rec.error_message or "")
        )


def test_the_policy_judges_the_path_a_tool_request_middleware_rewrote(
    home: Home, gateway: Any, workers: Any, conn: Any, ran: Path, hook_log: Path
) -> None:
    from broker.audit import AuditLog

    recorder(home, ran)
    home.tool("peek", function=ECHO, timeout=10)  # the same rule on a python tool
    home.config({"policy": {"args": {"path_prefixes": {"*": ["/srv/data"]}}}})
    install_plugin(home)
    gateway.sync_tools()
    workers(1, env={"POST_HOOK_LOG": str(hook_log)})

    # "~/notes" would be outside /srv/data as sent; the middleware maps it inside and the policy agrees.
    ok = gateway.call_tool("record", {"path": "~/notes"})
    assert ok.result(20) == "/srv/data/notes"
    # "/srv/data/escape" is inside as sent; the middleware rewrites it to /etc/passwd and that is refused.
    bad = gateway.call_tool("record", {"path": "/srv/data/escape"})
    err = denied(bad)
    assert err.details["rule"] == "args.path_prefixes.*" and "/etc/passwd" in str(err)
    assert runs(ran) == ["/srv/data/notes"]
    assert gateway.call_tool("peek", {"path": "~/x"}).result(20) == {"path": "/srv/data/x"}
    denied(gateway.call_tool("peek", {"path": "/etc/shadow"}))  # no rewrite, judged as sent

    audit = AuditLog(conn)
    good, refused = audit.get(ok.call_id), audit.get(bad.call_id)
    assert good is not None and refused is not None
    assert good.args == {"path": "/srv/data/notes"} and refused.args == {"path": "/etc/passwd"}
    assert good.middleware_trace == [
        {"source": "path-probe", "reason": "home paths live under /srv/data"}
    ]
    assert refused.middleware_trace[0]["reason"] == "a bad rewrite"


def test_a_worker_started_after_a_push_uses_the_pushed_policy_not_its_config(
    home: Home, gateway: Any, workers: Any, conn: Any
) -> None:
    from workers.policy import Policy

    home.noop_tool("open")
    gateway.sync_tools()
    policy_store.push(conn, Policy.from_dict({"mode": "strict"}), source="test")
    workers(1)  # its config.yaml has no policy: permissive
    assert denied(gateway.call_tool("open", {})).details["rule"] == "mode.strict"
    policy_store.clear(conn)
    wait_until(lambda: _open(gateway), 10, message="the cleared policy to fall back to config.yaml")


def _open(gateway: Any) -> bool:
    try:
        gateway.call_tool("open", {}).result(20)
    except PermissionDenied:
        return False
    return True


def test_path_rules_judge_nested_and_unconventionally_named_paths_on_real_workers(
    home: Home, gateway: Any, workers: Any, tmp_path: Path
) -> None:
    # Issue 24.2: `cat {{opts.path}}` and `cat {{filePath}}` read /etc/hostname past a path rule.
    allowed_dir = tmp_path / "data"
    allowed_dir.mkdir()
    (allowed_dir / "ok.txt").write_text("fine")
    home.tool(
        "cat_opts",
        "command",
        command="cat -- {{opts.path}}",
        input_schema={"type": "object", "properties": {"opts": {"type": "object"}}},
    )
    home.tool("cat_camel", "command", command="cat -- {{filePath}}")
    home.tool("read_nested", "python", function=ECHO)  # its "file" is nested in a list of records
    home.config({"policy": {"args": {"path_prefixes": {"*": [str(allowed_dir)]}}}})
    gateway.sync_tools()
    workers(1)
    secret = "/etc/hostname"
    attempts = [
        ("cat_opts", {"opts": {"path": secret}}),
        ("cat_opts", {"opts": {"path": f"{allowed_dir}/../../../../etc/hostname"}}),
        ("cat_camel", {"filePath": secret}),
        ("read_nested", {"batch": [{"file": str(allowed_dir / "ok.txt")}, {"file": secret}]}),
    ]
    for name, args in attempts:
        with pytest.raises(PermissionDenied, match="outside the allowed prefixes"):
            gateway.call_tool(name, args).result(timeout=20)
    assert gateway.call_tool("cat_opts", {"opts": {"path": str(allowed_dir / "ok.txt")}}).result(timeout=20) == "fine"
    assert gateway.call_tool("cat_camel", {"filePath": str(allowed_dir / "ok.txt")}).result(timeout=20) == "fine"


def test_a_path_rule_keyed_by_a_tool_glob_judges_every_tool_it_matches(
    home: Home, gateway: Any, workers: Any, tmp_path: Path
) -> None:
    # `fs_*` as the key, as deny_tools/allow_tools take globs: the rule applied to no tool, silently.
    allowed_dir = tmp_path / "data"
    allowed_dir.mkdir()
    (allowed_dir / "ok.txt").write_text("fine")
    home.tool("fs_cat", "command", command="cat -- {{path}}")
    home.config({"policy": {"args": {"path_prefixes": {"fs_*": [str(allowed_dir)]}}}})
    gateway.sync_tools()
    workers(1)
    with pytest.raises(PermissionDenied, match="outside the allowed prefixes") as info:
        gateway.call_tool("fs_cat", {"path": "/etc/hostname"}).result(timeout=20)
    assert info.value.details["rule"] == "args.path_prefixes.fs_*"
    assert gateway.call_tool("fs_cat", {"path": str(allowed_dir / "ok.txt")}).result(timeout=20) == "fine"
