"""Policy: modes, grants and denials per principal, argument rules, explain, and shipping as data."""

from __future__ import annotations

from typing import Any

import pytest

from broker.config import load_settings
from broker.errors import ConfigError, DecodeError, PermissionDenied, error_from_wire
from broker.toolspec import ToolSpec
from workers.policy import ANONYMOUS, STRICT, Policy
from workers.specs import check_spec


def spec(name: str, permissions: list[str] | None = None) -> ToolSpec:
    data: dict[str, Any] = {"name": name, "executor": "command", "command": "true"}
    if permissions is not None:
        data["permissions"] = permissions
    return check_spec(data)


UNDECLARED = spec("legacy")
EMPTY = spec("ping", [])
READ = spec("read_file", ["read_only"])
WRITE = spec("write_file", ["read_only", "write"])
ADMIN = spec("rm_rf", ["admin"])
ALL = [UNDECLARED, EMPTY, READ, WRITE, ADMIN]

CONFIG: dict[str, Any] = {
    "principals": {
        "agent-a": {"grants": ["read_only", "write"], "deny_tools": ["rm_rf"]},
        "ops-*": {"grants": ["*"]},
        "*": {"grants": ["read_only"]},
    },
}


def policy(**over: Any) -> Policy:
    return Policy.from_dict({**CONFIG, **over})


def allowed(p: Policy, who: str | None) -> list[str]:
    return [s.name for s in p.allowed_tools(who, ALL)]


def test_permissive_lets_undeclared_tools_through_but_still_checks_declared_tags() -> None:
    p = policy(mode="permissive")
    assert allowed(p, "agent-b") == ["legacy", "ping", "read_file"]
    d = p.check("agent-b", UNDECLARED)
    assert d.allowed and d.rule == "mode.permissive"


def test_strict_refuses_undeclared_tools_and_allows_declared_empty_ones() -> None:
    p = policy(mode="strict")
    assert allowed(p, "agent-b") == ["ping", "read_file"]
    d = p.check("agent-b", UNDECLARED)
    assert not d.allowed and d.rule == "mode.strict" and d.missing == ()


def test_a_declared_tool_needs_every_tag_in_both_modes() -> None:
    for mode in ("permissive", "strict"):
        d = policy(mode=mode).check("agent-b", WRITE)
        assert not d.allowed
        assert d.rule == "permissions"
        assert d.missing == ("write",)  # read_only comes from "*", write is nobody's grant for agent-b


def test_grants_are_the_union_of_every_matching_principals_entry() -> None:
    p = policy()
    held = dict(p.grants_of("agent-a"))
    assert held == {"read_only": "principals.agent-a", "write": "principals.agent-a"}
    assert dict(p.grants_of("agent-b")) == {"read_only": "principals.*"}
    assert p.check("agent-a", WRITE).allowed


def test_a_glob_principal_with_the_all_tags_grant_may_call_admin_tools() -> None:
    p = policy(mode="strict")
    assert allowed(p, "ops-1") == ["ping", "read_file", "write_file", "rm_rf"]
    assert not p.check("agent-b", ADMIN).allowed


def test_a_principal_deny_beats_its_grants() -> None:
    p = policy(principals={"agent-a": {"grants": ["admin"], "deny_tools": ["rm_rf"]}})
    d = p.check("agent-a", ADMIN)
    assert not d.allowed and d.rule == "principals.agent-a.deny_tools"
    assert p.check("agent-z", ADMIN).rule == "permissions"


def test_global_deny_tools_refuse_everyone_including_all_tag_holders_and_accept_globs() -> None:
    p = policy(deny_tools=["write_*"])
    for who in ("agent-a", "ops-1", None):
        d = p.check(who, WRITE)
        assert not d.allowed and d.rule == "deny_tools"
    assert p.check("ops-1", READ).allowed


def test_allow_tools_restrict_globally_and_per_principal() -> None:
    p = policy(allow_tools=["read_file", "ping"])
    assert allowed(p, "ops-1") == ["ping", "read_file"]
    assert p.check("ops-1", WRITE).rule == "allow_tools"
    q = Policy.from_dict({"principals": {"bot": {"grants": ["*"], "allow_tools": ["ping"]}}})
    assert allowed(q, "bot") == ["ping"]
    assert q.check("bot", READ).rule == "principals.bot.allow_tools"
    assert allowed(q, "other") == ["legacy", "ping"]  # the rule is bot's alone


def test_a_call_without_principal_acts_as_the_default_principal() -> None:
    p = policy()
    assert p.principal_of(None) == ANONYMOUS
    assert p.check(None, READ).allowed  # "*" covers the anonymous principal too
    assert p.check(None, WRITE).principal == ANONYMOUS
    q = policy(default_principal="agent-a")
    assert q.check(None, WRITE).allowed
    assert q.check("", WRITE).principal == "agent-a"


def test_enforce_raises_permission_denied_naming_tool_principal_missing_and_rule() -> None:
    p = policy(mode=STRICT)
    with pytest.raises(PermissionDenied) as exc:
        p.enforce("agent-b", WRITE, {})
    err = exc.value
    assert err.type == "permission_denied"
    assert err.details == {
        "tool": "write_file",
        "principal": "agent-b",
        "missing": ["write"],
        "rule": "permissions",
    }
    back = error_from_wire(err.to_wire())  # what the client rebuilds from the wire
    assert isinstance(back, PermissionDenied) and back.details["missing"] == ["write"]
    assert p.enforce("agent-a", WRITE, {}).allowed


def test_explain_says_mode_tags_sources_missing_verdict_and_fix() -> None:
    text = policy(mode=STRICT).explain("agent-b", WRITE)
    assert "principal 'agent-b'" in text and "tool 'write_file'" in text
    assert "mode:           strict" in text
    assert "tool declares:  read_only, write" in text
    assert "read_only      from principals.*.grants" in text
    assert "missing:        write" in text
    assert "DENIED by rule 'permissions'" in text
    assert "grant write in a new entry policy.principals.agent-b" in text


def test_explain_for_the_seeds_listed_but_denied_pitfall_on_an_undeclared_tool() -> None:
    text = policy(mode=STRICT).explain(None, UNDECLARED)
    assert "acts as default_principal 'anonymous'" in text
    assert "no permissions declaration" in text
    assert "DENIED by rule 'mode.strict'" in text
    assert "permissions: [tags]" in text
    ok = policy().explain("agent-a", UNDECLARED)
    assert "ALLOWED" in ok and "strict mode would refuse it" in ok


def test_explain_for_a_denied_tool_names_the_list_to_edit() -> None:
    text = policy().explain("agent-a", ADMIN)
    assert "DENIED by rule 'principals.agent-a.deny_tools'" in text
    assert "from policy.principals.agent-a.deny_tools" in text


# --- argument rules on the effective args ---------------------------------------------------------

PATHS = {
    "args": {
        "path_prefixes": {
            "read_file": ["/srv/data"],
            "write_file": {"args": ["dest"], "allow": ["/tmp/out/"]},
        }
    }
}


def test_path_prefixes_judge_path_like_args_and_normalise_traversal() -> None:
    p = policy(**PATHS)
    assert p.check("agent-a", READ, {"path": "/srv/data/a.txt"}).allowed
    assert p.check("agent-a", READ, {"path": "/srv/data"}).allowed
    for bad in ("/srv/database/x", "/srv/data/../../etc/passwd", "etc/passwd", 7):
        d = p.check("agent-a", READ, {"path": bad})
        assert not d.allowed and d.rule == "args.path_prefixes.read_file", bad
    assert not p.check("agent-a", READ, {"input_file": "/etc/shadow"}).allowed  # *_file is path-like
    assert not p.check("agent-a", READ, {"path": ["/srv/data/a", "/etc/x"]}).allowed


def test_named_path_args_are_the_only_ones_judged() -> None:
    p = policy(**PATHS)
    assert p.check("agent-a", WRITE, {"dest": "/tmp/out/r.txt", "path": "/anything"}).allowed
    assert not p.check("agent-a", WRITE, {"dest": "/tmp/other"}).allowed


def test_policy_judges_the_path_a_tool_request_middleware_rewrote() -> None:
    # A tool_request middleware returns a full replacement {"args": ...}; policy sees what it returned.
    def jail(*, tool_name: str, args: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {"args": {**args, "path": "/srv/data/" + args["path"].lstrip("/")}, "source": "jail"}

    def escape(*, tool_name: str, args: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {"args": {**args, "path": "/etc/passwd"}, "source": "evil"}

    p = policy(**PATHS)
    raw = {"path": "reports/q1.csv"}
    assert not p.check("agent-a", READ, raw).allowed  # the raw args would be refused
    for mw, ok in ((jail, True), (escape, False)):
        effective = mw(tool_name="read_file", args=dict(raw))["args"]
        assert p.check("agent-a", READ, effective).allowed is ok


def test_allowed_tools_ignores_argument_rules() -> None:
    assert "read_file" in allowed(policy(**PATHS), "agent-a")


# --- configuration and shipping -----------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"mode": "lenient"},
        {"deny_tool": ["x"]},
        {"principals": {"a": {"grant": ["x"]}}},
        {"principals": {"a": {"grants": [1]}}},
        {"principals": ["a"]},
        {"args": {"path_prefixes": {"t": {"prefixes": ["/x"]}}}},
        {"args": {"regex": {}}},
    ],
)
def test_invalid_policy_config_is_a_config_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Policy.from_dict(bad)


def test_principal_list_shorthand_means_grants() -> None:
    p = Policy.from_dict({"principals": {"a": ["write"]}})
    assert dict(p.grants_of("a")) == {"write": "principals.a"}


def test_encode_decode_round_trips_and_digest_tracks_content() -> None:
    p = policy(mode=STRICT, deny_tools=["x"], allow_tools=["read_*", "ping"], **PATHS)
    q = Policy.decode(p.encode())
    assert q == p and q.digest() == p.digest()
    assert [q.check("agent-a", s, {"path": "/srv/data/1"}).allowed for s in ALL] == [
        p.check("agent-a", s, {"path": "/srv/data/1"}).allowed for s in ALL
    ]
    assert policy(mode=STRICT).digest() != policy().digest()
    with pytest.raises(DecodeError):
        Policy.decode(b"\x93\x01\x02")


def test_from_settings_reads_the_policy_section_of_config_yaml(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv("HERMES_HOME", raising=False)
    (tmp_path / "config.yaml").write_text(
        "policy:\n"
        "  mode: strict\n"
        "  deny_tools: [dangerous]\n"
        "  principals:\n"
        "    agent-a: {grants: [read_only, write], deny_tools: [rm_rf]}\n"
        '    "*": {grants: [read_only]}\n',
        encoding="utf-8",
    )
    p = Policy.from_settings(load_settings(tmp_path).policy)
    assert p.mode == STRICT
    assert p.check("agent-a", WRITE).allowed
    assert p.check("agent-a", spec("dangerous", [])).rule == "deny_tools"
    assert Policy.from_settings({}).mode == "permissive"


def test_the_seeds_mode_names_are_aliases_and_an_unknown_mode_names_the_choices() -> None:
    assert Policy.from_dict({"mode": "blacklist"}).mode == STRICT
    assert Policy.from_dict({"mode": "whitelist"}).mode == "permissive"
    assert not Policy.from_dict({"mode": "blacklist"}).check(None, spec("open")).allowed
    with pytest.raises(ConfigError, match="policy.mode: expected one of .*got 'greylist'"):
        Policy.from_dict({"mode": "greylist"})
