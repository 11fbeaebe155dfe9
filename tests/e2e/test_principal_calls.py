"""Calls are per principal on a real `serve` (real workers, real Redis; issue 31.1-2): a token that is not
admin sees, follows, cancels and replays its own principal's calls only, and another principal's call id
is answered exactly as an unknown one; a replay runs as the replaying token's principal under the policy,
and names the call it replays. Admin tokens see every call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import yaml

from broker import keys
from tests.conftest import Home, wait_until
from tests.e2e.served import ADMIN, ALICE, api, client, configure, serve_processes, sha

pytestmark = pytest.mark.e2e
serve = pytest.fixture(serve_processes)

BOB = "bob-token-for-tests"  # grants read_only and payroll
CI = "ci-token-for-tests"  # an admin entry of api.tokens, principal ci, granted read_only only
UNKNOWN = "{tools}." + "0" * 32  # a well-formed id that names no call
NAP_SCHEMA = {"type": "object", "properties": {"seconds": {"type": "number"}, "path": {"type": "string"}}}


def setup(home: Home) -> None:
    configure(home)
    config = yaml.safe_load((home.path / "config.yaml").read_text())
    config["api"]["tokens"][sha(BOB)] = {"principal": "bob"}
    config["api"]["tokens"][sha(CI)] = {"principal": "ci", "admin": True}
    config["policy"]["principals"]["bob"] = {"grants": ["read_only", "payroll"]}
    config["policy"]["principals"]["ci"] = {"grants": ["read_only"]}
    home.config(config)
    home.tool("payroll", function="tests.e2e.stoptools:nap", timeout=20, permissions=["payroll"], input_schema=NAP_SCHEMA)


def runs(path: Path) -> int:
    """How many times the payroll tool ran: its own side effect, one line per run."""
    log = Path(f"{path}.log")
    return log.read_text().count("start") if log.exists() else 0


def as_unknown(response: httpx.Response, call_id: str) -> Any:
    """The response's body with ``call_id`` written as UNKNOWN's: the same as an unknown id's, or not."""
    return response.status_code, response.text.replace(call_id, UNKNOWN)


def test_a_token_sees_and_acts_on_its_own_principals_calls_only_and_anothers_id_is_unknown(
    home: Home, serve: Any, workers: Any, conn: Any
) -> None:
    setup(home)
    workers(1)
    server = serve()
    with api(server, ALICE) as alice, api(server, BOB) as bob, api(server, ADMIN) as admin, api(server, CI) as ci:
        done = bob.post("/v1/tools/lookup/calls", json={"args": {"city": "bob-city"}, "wait": 20}).json()
        assert done["state"] == "done"
        running = bob.post("/v1/tools/sleep/calls", json={"args": {"seconds": 20}}).json()["call_id"]
        mine = alice.post("/v1/tools/lookup/calls", json={"args": {"city": "alice-city"}, "wait": 20}).json()
        assert mine["state"] == "done"
        bob.post("/v1/tools/wipe/calls", json={"args": {}, "wait": 20})  # a failure of bob's (policy)
        alice.post("/v1/tools/wipe/calls", json={"args": {}, "wait": 20})  # and one of alice's
        wait_until(lambda: len(admin.get("/v1/status").json()["recent_failures"]) == 2, 10, message="two failures")
        wait_until(lambda: admin.get(f"/v1/audit/{quote(done['call_id'])}").status_code == 200, 10)

        routes = ["/v1/calls/{}", "/v1/calls/{}/request", "/v1/calls/{}/events", "/v1/audit/{}"]
        for call_id in (done["call_id"], running):
            for route in routes:
                theirs = alice.get(route.format(quote(call_id)))
                unknown = alice.get(route.format(quote(UNKNOWN)))
                assert unknown.status_code == 404, (route, unknown.text)
                assert as_unknown(theirs, call_id) == as_unknown(unknown, UNKNOWN), route
            # (cancel takes no body: one answered unread closes its connection, http_limits)
            for route, body in (("/v1/calls/{}/cancel", None), ("/v1/audit/{}/replay", {})):
                theirs = alice.post(route.format(quote(call_id)), json=body)
                unknown = alice.post(route.format(quote(UNKNOWN)), json=body)
                assert unknown.status_code == 404 and as_unknown(theirs, call_id) == as_unknown(unknown, UNKNOWN), route
        # Her cancel did nothing: bob's call runs on, and bob may cancel it.
        assert bob.get(f"/v1/calls/{quote(running)}").json()["state"] == "executing"
        assert conn.hget(keys.job(running), keys.F_CANCEL) is None
        assert bob.post(f"/v1/calls/{quote(running)}/cancel").json()["cancelled"] is True

        # Lists: her own records and failures only; another principal's name lists nothing.
        assert alice.get("/v1/audit", params={"principal": "bob"}).json() == []
        listed = alice.get("/v1/audit").json()
        assert {r["principal"] for r in listed} == {"alice"} and mine["call_id"] in {r["call_id"] for r in listed}
        failures = alice.get("/v1/status").json()["recent_failures"]
        assert [f["principal"] for f in failures] == ["alice"]
        assert done["call_id"] not in alice.get("/v1/status").text and running not in alice.get("/v1/status").text
        # Usage per principal: hers alone (bob's name and calls are not hers to see), everyone's for an admin.
        wait_until(lambda: {"alice", "bob"} <= {u["principal"] for u in admin.get("/v1/status").json()["usage"]}, 10,
                   message="both principals' usage")
        assert {u["principal"] for u in alice.get("/v1/status").json()["usage"]} == {"alice"}
        assert {u["principal"] for u in _stats(alice)["usage"]} == {"alice"}

        # Her own: every route answers.
        own = quote(mine["call_id"])
        assert alice.get(f"/v1/calls/{own}").json()["result"] == {"city": "alice-city"}
        assert alice.get(f"/v1/calls/{own}/request").status_code == 200
        assert alice.get(f"/v1/calls/{own}/events").status_code in (200, 204)
        assert alice.get(f"/v1/audit/{own}").json()["record"]["principal"] == "alice"

        # Admin tokens (the single token, an admin entry) see every call.
        for each in (admin, ci):
            assert each.get(f"/v1/calls/{quote(done['call_id'])}").json()["result"] == {"city": "bob-city"}
            assert each.get(f"/v1/audit/{quote(done['call_id'])}").status_code == 200
            assert {r["principal"] for r in each.get("/v1/audit", params={"principal": "bob"}).json()} == {"bob"}
        assert {f["principal"] for f in admin.get("/v1/status").json()["recent_failures"]} == {"alice", "bob"}

    # Through /mcp: bob's MCP call is bob's, and alice cannot open it.
    async def bob_over_mcp() -> None:
        async with client(server.url, BOB) as c:
            result = await c.call_tool("lookup", {"city": "via-mcp"})
            assert not result.is_error

    asyncio.run(bob_over_mcp())
    with api(server, ALICE) as alice, api(server, BOB) as bob:
        wait_until(lambda: any(r["args"] == {"city": "via-mcp"} for r in bob.get("/v1/audit").json()), 10)
        via = next(r for r in bob.get("/v1/audit").json() if r["args"] == {"city": "via-mcp"})
        assert via["principal"] == "bob"
        assert alice.get(f"/v1/calls/{quote(via['call_id'])}").status_code == 404
        assert alice.get(f"/v1/audit/{quote(via['call_id'])}").status_code == 404


def test_a_replay_runs_as_the_replaying_tokens_principal_and_only_an_admin_replays_anothers_call(
    home: Home, serve: Any, workers: Any, tmp_path: Path
) -> None:
    setup(home)
    workers(1)
    server = serve()
    ran = tmp_path / "payroll"
    body = {"args": {"seconds": 0, "path": str(ran)}, "wait": 20}
    with api(server, ALICE) as alice, api(server, BOB) as bob, api(server, ADMIN) as admin, api(server, CI) as ci:
        paid = bob.post("/v1/tools/payroll/calls", json=body).json()
        assert paid["state"] == "done" and runs(ran) == 1
        denied = alice.post("/v1/tools/payroll/calls", json=body).json()
        assert denied["error"]["type"] == "permission_denied" and runs(ran) == 1
        original = quote(paid["call_id"])
        wait_until(lambda: admin.get(f"/v1/audit/{original}").status_code == 200, 10, message="bob's record")
        wait_until(lambda: alice.get(f"/v1/audit/{quote(denied['call_id'])}").status_code == 200, 10)

        # alice replaying bob's call: as an unknown id; nothing ran.
        theirs = alice.post(f"/v1/audit/{original}/replay", json={})
        unknown = alice.post(f"/v1/audit/{quote(UNKNOWN)}/replay", json={})
        assert theirs.status_code == 404 and as_unknown(theirs, paid["call_id"]) == as_unknown(unknown, UNKNOWN)
        # Her own call replays as her, under the policy: refused again.
        again = alice.post(f"/v1/audit/{quote(denied['call_id'])}/replay", json={}).json()
        assert again["state"] == "failed" and again["error"]["type"] == "permission_denied"
        assert again["record"]["principal"] == "alice" and again["record"]["replay_of"] == denied["call_id"]
        assert runs(ran) == 1

        # An admin entry replays bob's call as itself (ci, granted read_only): the policy refuses it.
        as_ci = ci.post(f"/v1/audit/{original}/replay", json={}).json()
        assert as_ci["state"] == "failed" and as_ci["error"]["type"] == "permission_denied", as_ci
        assert as_ci["record"]["principal"] == "ci" and as_ci["record"]["replay_of"] == paid["call_id"]
        assert runs(ran) == 1
        # The single token (principal admin, granted everything) replays it as admin: it runs, once.
        as_admin = admin.post(f"/v1/audit/{original}/replay", json={}).json()
        assert as_admin["state"] == "done", as_admin
        assert as_admin["record"]["principal"] == "admin" and as_admin["record"]["replay_of"] == paid["call_id"]
        assert runs(ran) == 2
        # bob replays his own, as bob.
        own = bob.post(f"/v1/audit/{original}/replay", json={}).json()
        assert own["state"] == "done" and own["record"]["principal"] == "bob" and runs(ran) == 3
        # The replays are in the audit list, each naming the original.
        replays = [r for r in admin.get("/v1/audit").json() if r.get("replay_of") == paid["call_id"]]
        assert sorted(r["principal"] for r in replays) == ["admin", "bob", "ci"]


def test_a_stateful_mcp_session_answers_only_the_principal_that_opened_it(home: Home, serve: Any) -> None:
    setup(home)
    server = serve("--mcp-stateful")
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    with api(server, ALICE) as alice, api(server, BOB) as bob:
        opened = alice.post("/mcp", json=initialize, headers=headers)
        assert opened.status_code == 200, opened.text
        session = {**headers, "Mcp-Session-Id": opened.headers["mcp-session-id"], "Mcp-Protocol-Version": "2025-06-18"}
        alice.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session)
        listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        # bob holding alice's session id (to cancel her requests, to read her stream) is told it does not exist.
        theirs = bob.post("/mcp", json=listing, headers=session)
        unknown = bob.post("/mcp", json=listing, headers={**session, "Mcp-Session-Id": "0" * 32})
        assert theirs.status_code == 404 and theirs.text == unknown.text, theirs.text
        mine = alice.post("/mcp", json=listing, headers=session)
        assert mine.status_code == 200 and "lookup" in mine.text, mine.text


def test_a_call_the_reaper_ends_is_still_its_principals_in_the_audit_log(home: Home, serve: Any, workers: Any) -> None:
    setup(home)
    (victim,) = workers(1, lease=1.0)
    server = serve()
    with api(server, ALICE) as alice:
        call_id = alice.post("/v1/tools/sleep/calls", json={"args": {"seconds": 30}, "max_attempts": 1}).json()["call_id"]
        wait_until(lambda: alice.get(f"/v1/calls/{quote(call_id)}").json()["state"] == "executing", 10)
        victim.kill()
        workers(1, lease=1.0)  # its reaper ends the call: worker_lost, no attempts left
        wait_until(lambda: alice.get(f"/v1/calls/{quote(call_id)}").json()["state"] == "failed", 20)
        found = wait_until(lambda: (r := alice.get(f"/v1/audit/{quote(call_id)}")).status_code == 200 and r, 10)
        record = found.json()["record"]
        assert record["principal"] == "alice" and record["error_type"] == "worker_lost"


def _stats(client: httpx.Client) -> dict[str, Any]:
    """The first snapshot on ``/v1/stream/stats``."""
    import json

    with client.stream("GET", "/v1/stream/stats") as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                return dict(json.loads(line.split(":", 1)[1]))
    raise AssertionError("no snapshot")


def _stats_batches(client: httpx.Client) -> list[dict[str, Any]]:
    """The batches of the first snapshot on ``/v1/stream/stats``."""
    return list(_stats(client)["batches"])


def test_a_batch_is_its_principals_alone_over_every_route_and_the_stats_stream(
    home: Home, serve: Any, workers: Any, conn: Any
) -> None:
    setup(home)
    workers(1)
    server = serve()
    with api(server, ALICE) as alice, api(server, BOB) as bob, api(server, ADMIN) as admin:
        made = bob.post("/v1/batches?tool=lookup", json=[{"city": "x"}, {"city": "y"}])
        assert made.status_code == 202, made.text
        batch_id = made.json()["id"]
        assert len(bob.get(f"/v1/batches/{batch_id}/results").text.splitlines()) == 2  # (followed to its end)
        assert batch_id in {b["id"] for b in bob.get("/v1/batches").json()}
        assert batch_id in {b["id"] for b in admin.get("/v1/batches").json()}
        assert batch_id not in {b["id"] for b in alice.get("/v1/batches").json()}
        for method, path in (("GET", ""), ("GET", "/results"), ("DELETE", "")):
            r = alice.request(method, f"/v1/batches/{batch_id}{path}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_batch", r.text
        # The console's live stats: bob's batch is bob's (and the admin's), not alice's.
        assert [b["id"] for b in _stats_batches(bob)] == [batch_id]
        assert batch_id in {b["id"] for b in _stats_batches(admin)}
        assert _stats_batches(alice) == []
        from hermes_gateway.batches import BatchStore

        for _ in range(120):  # alice's newer batches do not hide bob's from bob (the newest 100 / 20 were read)
            BatchStore(conn).create("lookup", ["tools"], ttl=60, window=1, principal="alice")
        assert [b["id"] for b in bob.get("/v1/batches").json()] == [batch_id]
        assert [b["id"] for b in _stats_batches(bob)] == [batch_id]
        assert len(alice.get("/v1/batches").json()) == 100 and len(_stats_batches(alice)) == 20


def test_a_token_may_shorten_a_calls_timeout_but_only_an_admin_may_lengthen_it(
    home: Home, serve: Any, workers: Any, tmp_path: Path
) -> None:
    setup(home)
    workers(1)
    server = serve()
    marks = str(tmp_path / "nap")
    with api(server, BOB) as bob, api(server, ADMIN) as admin:
        longer = bob.post("/v1/tools/payroll/calls", json={"args": {"seconds": 0.01, "path": marks}, "timeout": 3600})
        assert longer.status_code == 400 and "at most 20 s" in longer.json()["error"]["message"]
        assert runs(Path(marks)) == 0  # refused before it became a call
        shorter = bob.post(
            "/v1/tools/payroll/calls", json={"args": {"seconds": 5, "path": marks}, "timeout": 0.5, "wait": 20}
        ).json()
        assert shorter["state"] == "failed" and shorter["error"]["type"] == "tool_timeout"
        by_admin = admin.post(
            "/v1/tools/payroll/calls",
            json={"args": {"seconds": 0.01, "path": marks}, "timeout": 3600, "wait": 20, "principal": "bob"},
        ).json()
        assert by_admin["state"] == "done"


def test_a_token_that_may_not_manage_tools_reads_a_spec_with_every_literal_header_and_env_value_masked(
    home: Home, serve: Any
) -> None:
    setup(home)
    home.tool(
        "deploy", executor="command", command="deploy {{target}}",
        env_set={"DB_PASS": "hunter2-literal", "TARGET": "{{target}}"},
        input_schema={"type": "object", "properties": {"target": {"type": "string"}}},
    )  # fmt: skip
    server = serve()
    with api(server, BOB) as bob, api(server, ADMIN) as admin:
        shown = bob.get("/v1/tools/deploy").json()
        assert shown["env_set"] == {"DB_PASS": "***", "TARGET": "{{target}}"}  # (a placeholder is no secret)
        assert "hunter2" not in json.dumps(shown)
        assert admin.get("/v1/tools/deploy").json()["env_set"]["DB_PASS"] == "hunter2-literal"


def test_a_principals_batch_stays_in_its_list_behind_a_hundred_newer_of_anothers(
    home: Home, serve: Any, workers: Any, conn: Any
) -> None:
    from hermes_gateway.batches import BatchStore

    setup(home)
    workers(1)
    server = serve()
    with api(server, ALICE) as alice, api(server, ADMIN) as admin:
        made = alice.post("/v1/batches?tool=lookup", json=[{"city": "x"}])
        assert made.status_code == 202, made.text
        mine = made.json()["id"]
        store = BatchStore(conn)
        for _ in range(100):  # bob's, newer (the list shows the newest 100)
            store.create("lookup", ["tools"], ttl=600, window=1, principal="bob")
        assert [b["id"] for b in alice.get("/v1/batches").json()] == [mine]
        assert mine not in {b["id"] for b in admin.get("/v1/batches").json()}  # (an admin's: the newest 100 of all)
