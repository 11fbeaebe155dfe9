"""Principals bound to credentials on a real `serve` (real workers, real Redis): a token is who calls; a
caller cannot claim another principal, cannot register tools without the grant, and cannot get another
principal's result by reusing its idempotency key."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from tests.conftest import Home
from tests.e2e.served import ADMIN, ALICE, api, client, configure, serve_processes

pytestmark = pytest.mark.e2e
serve = pytest.fixture(serve_processes)

BOB = "bob-token-for-tests"  # a principal granted tools:write, and nothing else
NEW_TOOL = {"name": "fresh", "executor": "python", "function": "workers.executors.builtin:noop", "permissions": ["read_only"]}


def setup(home: Home) -> None:
    configure(home)
    config = __import__("yaml").safe_load((home.path / "config.yaml").read_text())
    config["api"]["tokens"][hashlib.sha256(BOB.encode()).hexdigest()] = {"principal": "bob"}
    config["policy"]["principals"]["bob"] = {"grants": ["tools:write"]}
    home.config(config)


def test_a_caller_cannot_claim_another_principal_and_its_own_decides_calls_and_lists(
    home: Home, serve: Any, workers: Any
) -> None:
    setup(home)
    workers(1)
    server = serve()
    with api(server, ALICE) as alice, api(server, ADMIN) as admin:
        claimed = alice.post("/v1/tools/wipe/calls", json={"args": {}, "context": {"principal": "admin"}, "wait": 10})
        assert claimed.status_code == 403, claimed.text
        error = claimed.json()["error"]
        assert error["type"] == "permission_denied" and error["details"]["rule"] == "credentials"
        assert error["details"] == {"principal": "alice", "claimed": "admin", "rule": "credentials"}
        assert alice.get("/v1/schemas", params={"principal": "admin"}).status_code == 403

        # Her own principal is the policy's subject: named or not, it is alice that calls.
        own = alice.post("/v1/tools/lookup/calls", json={"args": {"city": "x"}, "context": {"principal": "alice"}, "wait": 20})
        assert own.status_code == 200 and own.json()["state"] == "done"
        wiped = alice.post("/v1/tools/wipe/calls", json={"args": {}, "wait": 20}).json()
        assert wiped["state"] == "failed" and wiped["error"]["details"]["principal"] == "alice"
        assert {s["function"]["name"] for s in alice.get("/v1/schemas").json()} == {"lookup", "steps", "sleep", "tight"}

        # The admin credential is a trusted back end: it may act for alice, and as itself sees everything.
        as_alice = admin.post("/v1/tools/wipe/calls", json={"args": {}, "context": {"principal": "alice"}, "wait": 20})
        assert as_alice.json()["error"]["details"]["principal"] == "alice"
        assert "wipe" in {s["function"]["name"] for s in admin.get("/v1/schemas").json()}

    async def listed(token: str) -> set[str]:
        async with client(server.url, token) as c:
            return {t.name for t in (await c.list_tools()).tools}

    assert asyncio.run(listed(ALICE)) == {"lookup", "steps", "sleep", "tight"}
    assert "wipe" in asyncio.run(listed(ADMIN))


def test_registering_and_removing_tools_needs_the_tools_write_grant(home: Home, serve: Any) -> None:
    setup(home)
    server = serve()
    with api(server, ALICE) as alice, api(server, BOB) as bob, api(server, ADMIN) as admin:
        refused = alice.post("/v1/tools", json=NEW_TOOL)
        assert refused.status_code == 403 and refused.json()["error"]["details"]["missing"] == ["tools:write"]
        assert alice.get("/v1/tools/fresh").status_code == 404  # nothing was registered
        # Re-registering an existing tool with other permissions is registration too.
        assert alice.post("/v1/tools", json={**NEW_TOOL, "name": "wipe"}).status_code == 403
        assert alice.delete("/v1/tools/lookup").status_code == 403
        assert alice.get("/v1/tools/lookup").status_code == 200

        assert bob.post("/v1/tools", json=NEW_TOOL).status_code == 201
        assert bob.delete("/v1/tools/fresh").status_code == 200
        assert admin.post("/v1/tools", json=NEW_TOOL).status_code == 201


def test_an_idempotency_key_is_the_principals_own_another_using_the_same_string_neither_blocks_nor_gets_its_call(
    home: Home, serve: Any, workers: Any
) -> None:
    """Keys were one namespace for every principal: alice, submitting first under the key admin would use
    ("pay-1"), had admin's own call refused with a 409 until her record expired (days, if it waited)."""
    setup(home)
    workers(1)
    server = serve()
    with api(server, ALICE) as alice, api(server, ADMIN) as admin:
        body = {"args": {"city": "secret"}, "idempotency_key": "pay-1", "wait": 20}
        taken = alice.post("/v1/tools/lookup/calls", json={**body, "args": {"city": "alice's"}})
        assert taken.status_code == 200 and taken.json()["result"] == {"city": "alice's"}
        first = admin.post("/v1/tools/lookup/calls", json=body)
        assert first.status_code == 200, first.text
        assert first.json()["result"] == {"city": "secret"} and first.json()["call_id"] != taken.json()["call_id"]
        reused = alice.post("/v1/tools/lookup/calls", json=body)  # admin's arguments under her own key: a conflict
        assert reused.status_code == 409, reused.text
        assert reused.json()["error"]["details"] == {"key": "pay-1"} and first.json()["call_id"] not in reused.text
        mine = alice.post("/v1/tools/lookup/calls", json={**body, "args": {"city": "alice's"}}).json()
        assert (mine["call_id"], mine["result"]) == (taken.json()["call_id"], {"city": "alice's"})
        again = admin.post("/v1/tools/lookup/calls", json=body).json()
        assert again["call_id"] == first.json()["call_id"] and again["result"] == {"city": "secret"}


def test_a_principal_named_with_the_stats_separator_counts_as_other_not_as_another_principal(
    home: Home, gateway: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    """``pcalls|<principal>|<kind>|<name>`` read "bob|tool|echo" as bob: its calls were bob's figures."""
    from broker import keys
    from workers.telemetry import read_stats

    home.echo_tool()
    gateway.sync_tools()
    workers(1)
    for who in ("bob", "bob|tool|echo", "bob|tool|echo"):
        gateway.call_tool("echo", {}, principal=who).result(10)
    stats = wait_until(lambda: sum((s := read_stats(conn)).pcalls.values()) == 3 and s, 10, message="the stats flush")
    assert stats.pcalls == {("bob", "tool", "echo"): 1, (keys.STATS_OTHER, "tool", "echo"): 2}
