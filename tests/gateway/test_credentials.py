"""Tokens bound to principals (``api.tokens``): who a token is, what it may claim, who may manage tools."""

from __future__ import annotations

import hashlib

import pytest

from broker.errors import ConfigError, PermissionDenied
from hermes_gateway.credentials import MANAGE_TOOLS, TRUSTED_LOCAL, Caller, Credentials, token_key
from workers.policy import Policy

ALICE_KEY = hashlib.sha256(b"alice-secret").hexdigest()


def test_a_token_is_the_principal_its_sha256_maps_to_and_unknown_tokens_are_nobody() -> None:
    creds = Credentials("admin-secret", {"token_principal": "ops", "tokens": {ALICE_KEY: {"principal": "alice"}}})
    assert token_key("alice-secret") == ALICE_KEY
    assert creds.required
    assert creds.caller("alice-secret") == Caller("alice", admin=False)
    assert creds.caller("admin-secret") == Caller("ops", admin=True)
    assert creds.caller("wrong") is None and creds.caller(None) is None and creds.caller("") is None
    assert creds.caller(ALICE_KEY) is None  # the stored hash is not itself a token


def test_without_any_token_every_caller_is_the_trusted_local_one() -> None:
    creds = Credentials(None, {})
    assert not creds.required and creds.caller(None) is TRUSTED_LOCAL and creds.caller("x") is TRUSTED_LOCAL


def test_a_caller_cannot_claim_another_principal_unless_it_is_an_admin_credential() -> None:
    alice = Caller("alice")
    assert alice.principal_for(None) == "alice" and alice.principal_for("alice") == "alice"
    with pytest.raises(PermissionDenied) as info:
        alice.principal_for("admin")
    assert info.value.details == {"principal": "alice", "claimed": "admin", "rule": "credentials"}
    with pytest.raises(PermissionDenied):
        alice.principal_for(["admin"])
    assert Caller("ops", admin=True).principal_for("alice") == "alice"
    assert Caller(None, admin=True).principal_for(None) is None  # the policy's default principal


def test_managing_tools_needs_the_tools_write_grant_or_an_admin_credential() -> None:
    policy = Policy.from_dict(
        {"principals": {"bob": {"grants": [MANAGE_TOOLS]}, "root": {"grants": ["*"]}, "alice": ["read_only"]}}
    )
    Caller("bob").check_manage_tools(policy)
    Caller("root").check_manage_tools(policy)
    Caller("alice", admin=True).check_manage_tools(policy)
    with pytest.raises(PermissionDenied) as info:
        Caller("alice").check_manage_tools(policy)
    assert info.value.details["missing"] == [MANAGE_TOOLS] and info.value.details["principal"] == "alice"
    with pytest.raises(PermissionDenied):
        Caller(None).check_manage_tools(policy)  # the default principal, anonymous, holds nothing


@pytest.mark.parametrize(
    ("api", "message"),
    [
        ({"tokens": {"not-a-hash": {"principal": "a"}}}, "64 lowercase hex"),
        ({"tokens": {ALICE_KEY.upper(): {"principal": "a"}}}, "64 lowercase hex"),
        ({"tokens": {ALICE_KEY: {"principal": ""}}}, "principal: expected a principal name"),
        ({"tokens": {ALICE_KEY: {"principal": "a", "admin": "yes"}}}, "admin: expected true or false"),
        ({"tokens": {ALICE_KEY: {"principal": "a", "role": "x"}}}, "expected {principal"),
        ({"tokens": ["x"]}, "api.tokens: expected a mapping"),
        ({"token": "x"}, "unknown key(s) ['token']"),
        ({"token_principal": 3}, "token_principal: expected a principal name"),
    ],
)
def test_a_mistyped_api_section_is_a_config_error(api: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        Credentials(None, api)
    assert message in str(info.value)
    assert "alice-secret" not in str(info.value)


def test_a_bare_principal_name_is_shorthand_for_an_entry() -> None:
    assert Credentials(None, {"tokens": {ALICE_KEY: "alice"}}).caller("alice-secret") == Caller("alice")
