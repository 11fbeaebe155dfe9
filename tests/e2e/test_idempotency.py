"""Idempotency keys end to end (real Redis, real workers): a key lives no longer than its call's record,
a key left without its record runs a new call, and a key reused for another tool or other arguments is
an ``idempotency_conflict`` (Python, asyncio, batches, HTTP 409)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from broker import keys
from broker.errors import IdempotencyConflict
from hermes_gateway.aio import AsyncGateway
from tests.e2e.test_http_api import Served

pytestmark = pytest.mark.e2e


def idem(key: str) -> str:
    return keys.idempotency("{tools}", key)


@pytest.fixture
def tools(home: Any, gateway: Any) -> None:
    home.echo_tool()
    home.sleep_tool()
    gateway.sync_tools()


def test_a_finished_calls_key_expires_with_its_record_then_the_key_runs_a_new_call(
    tools: None, gateway: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    workers(1, env={"HERMES_RESULT_TTL": "2"})
    # (a call that takes a moment: an echo could end before the key's TTL is read)
    first = gateway.call_tool("sleep", {"seconds": 0.5}, idempotency_key="ttl-1")
    assert conn.ttl(idem("ttl-1")) > 86400  # while it runs: as long as the pending record
    assert first.result(10) == {"slept": 0.5}
    wait_until(lambda: conn.ttl(keys.job(first.call_id)) <= 2, 5, message="the record's result TTL")
    assert 0 < conn.ttl(idem("ttl-1")) <= 2
    assert abs(conn.pttl(idem("ttl-1")) - conn.pttl(keys.job(first.call_id))) < 1000
    wait_until(lambda: not conn.exists(keys.job(first.call_id)), 6, 0.1, "the record to expire")
    assert not conn.exists(idem("ttl-1"))
    again = gateway.call_tool("sleep", {"seconds": 0.5}, idempotency_key="ttl-1")
    assert again.call_id != first.call_id and again.own
    assert again.result(10) == {"slept": 0.5}


def test_a_key_whose_record_is_gone_runs_a_new_call(tools: None, gateway: Any, workers: Any, conn: Any) -> None:
    # What an older version left: the key (7 days) outlived the record (1 day).
    workers(1)
    conn.set(idem("old-1"), "f" * 32, ex=7 * 86400)
    h = gateway.call_tool("echo", {"v": 2}, idempotency_key="old-1")
    assert h.call_id != "f" * 32
    assert h.result(10) == {"v": 2}
    assert conn.get(idem("old-1")) == h.call_id.encode()


def test_reusing_a_key_for_other_arguments_or_another_tool_is_a_conflict(
    tools: None, gateway: Any, workers: Any, conn: Any
) -> None:
    workers(1)
    first = gateway.call_tool("echo", {"amount": 10}, idempotency_key="pay-1")
    assert first.result(10) == {"amount": 10}
    same = gateway.call_tool("echo", {"amount": 10}, idempotency_key="pay-1", session_id="another-turn")
    assert (same.call_id, same.name, same.kind) == (first.call_id, "echo", "tool")
    assert same.result(5) == {"amount": 10}
    with pytest.raises(IdempotencyConflict) as info:
        gateway.call_tool("echo", {"amount": 99999}, idempotency_key="pay-1")
    assert info.value.to_wire() == {
        "type": "idempotency_conflict",
        "message": f"idempotency key 'pay-1' already belongs to call {first.call_id} of tool 'echo' with "
        "different arguments: reuse a key only to resubmit the same call",
        "details": {"key": "pay-1", "call_id": first.call_id, "tool": "echo", "kind": "tool"},
    }
    with pytest.raises(IdempotencyConflict) as info:
        gateway.call_tool("sleep", {"seconds": 0}, idempotency_key="pay-1")
    assert str(info.value) == (
        f"idempotency key 'pay-1' already belongs to call {first.call_id} of tool 'echo': "
        "it cannot be reused for tool 'sleep'"
    )
    assert gateway.router.handles == {}  # nothing left tracked for the refused submissions
    assert len(conn.keys("rq:job:*")) == 1


def test_a_batch_refuses_the_conflicting_item_and_accepts_the_rest(
    tools: None, gateway: Any, workers: Any
) -> None:
    workers(1)
    done = gateway.call_tool("echo", {"i": 0}, idempotency_key="b-0")
    other = gateway.call_tool("echo", {"i": 99}, idempotency_key="b-1")
    batch = gateway.map("echo", [{"i": 0}, {"i": 1}, {"i": 2}], idempotency_keys=["b-0", "b-1", None])
    assert [i for i, _ in batch.refused] == [1]
    refused = batch[1].refused
    assert isinstance(refused, IdempotencyConflict)
    assert refused.details == {"key": "b-1", "call_id": other.call_id, "tool": "echo", "kind": "tool"}
    with pytest.raises(IdempotencyConflict):
        batch[1].result()
    assert batch[0].call_id == done.call_id and batch[0].name == "echo"
    assert [batch[0].result(10), batch[2].result(10)] == [{"i": 0}, {"i": 2}]
    with pytest.raises(TypeError, match="idempotency_keys="):
        gateway.map("echo", [{"i": 0}], idempotency_key="b-0")
    with pytest.raises(ValueError, match="2 entries for 1 calls"):
        gateway.map("echo", [{"i": 0}], idempotency_keys=["b-0", "b-1"])


def test_the_async_client_raises_the_conflict_and_follows_the_same_request(
    tools: None, gateway: Any, workers: Any, redis_url: str, home: Any
) -> None:
    workers(1)

    async def scenario() -> Any:
        async with await AsyncGateway.connect(redis_url, home=str(home.path), embedded_ok=False) as gw:
            first = await gw.call_tool("echo", {"n": 1}, idempotency_key="a-1")
            same = await gw.call_tool("echo", {"n": 1}, idempotency_key="a-1")
            errors = []
            for name, args in (("echo", {"n": 2}), ("sleep", {"seconds": 0})):
                with pytest.raises(IdempotencyConflict) as info:
                    await gw.call_tool(name, args, idempotency_key="a-1")
                errors.append(info.value)
            batch = await gw.map("echo", [{"n": 1}, {"n": 3}, {"n": 4}], idempotency_keys=["a-1", "a-2", "a-1"])
            results = [await batch[0].result(10), await batch[1].result(10)]
            return first, same, errors, batch, results, await first.result(10)

    first, same, errors, batch, results, result = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert same.call_id == first.call_id and same.name == "echo"
    assert result == {"n": 1}
    assert [e.details["call_id"] for e in errors] == [first.call_id] * 2
    assert "with different arguments" in str(errors[0]) and "cannot be reused for tool 'sleep'" in str(errors[1])
    assert [i for i, _ in batch.refused] == [2]
    assert isinstance(batch[2].refused, IdempotencyConflict)
    assert batch[0].call_id == first.call_id
    assert results == [{"n": 1}, {"n": 3}]


def test_http_answers_a_conflict_with_409(tools: None, gateway: Any, workers: Any) -> None:
    workers(1)
    served = Served(gateway)
    try:
        with httpx.Client(base_url=served.base, timeout=30) as api:
            body = {"args": {"amount": 10}, "idempotency_key": "h-1", "wait": 10}
            first = api.post("/v1/tools/echo/calls", json=body)
            assert first.status_code == 200 and first.json()["result"] == {"amount": 10}
            call_id = first.json()["call_id"]
            again = api.post("/v1/tools/echo/calls", json=body)
            assert again.status_code == 200
            assert (again.json()["call_id"], again.json()["name"]) == (call_id, "echo")
            other_args = api.post("/v1/tools/echo/calls", json={**body, "args": {"amount": 99999}})
            other_tool = api.post("/v1/tools/sleep/calls", json={**body, "args": {"seconds": 0}})
    finally:
        served.stop()
    for response in (other_args, other_tool):
        assert response.status_code == 409
        error = response.json()["error"]
        assert error["type"] == "idempotency_conflict"
        assert error["details"] == {"key": "h-1", "call_id": call_id, "tool": "echo", "kind": "tool"}
    assert "cannot be reused for tool 'sleep'" in other_tool.json()["error"]["message"]


def test_an_idempotency_key_of_a_megabyte_is_refused_at_the_edge_and_nothing_is_stored(
    tools: None, gateway: Any, workers: Any, conn: Any
) -> None:
    """It was taken: a Redis key's name, a field of the job and a part of its payload, kept with the call
    (three copies of up to the 32 MB body limit per call, outside max_args)."""
    workers(1)
    served = Served(gateway)
    try:
        with httpx.Client(base_url=served.base, timeout=30) as api:
            huge = api.post("/v1/tools/echo/calls", json={"args": {}, "idempotency_key": "k" * (1 << 20), "wait": 10})
            fine = api.post("/v1/tools/echo/calls", json={"args": {}, "idempotency_key": "k" * 256, "wait": 10})
    finally:
        served.stop()
    assert huge.status_code == 400 and len(huge.content) < 1000
    assert huge.json()["error"]["type"] == "invalid_args" and "at most 256 characters" in huge.json()["error"]["message"]
    assert fine.status_code == 200 and fine.json()["state"] == "done"
    assert conn.exists(idem("k" * 256)) and not conn.exists(idem("k" * (1 << 20)))
    assert len(list(conn.scan_iter(keys.job("*")))) == 1  # the fine call's alone


def test_the_standard_idempotency_key_header_deduplicates_as_the_body_field_does(
    tools: None, gateway: Any, workers: Any, conn: Any
) -> None:
    # (a client sending the standard header got no deduplication and no word of it: the call ran twice)
    workers(1)
    served = Served(gateway)
    try:
        with httpx.Client(base_url=served.base, timeout=30) as api:
            body = {"args": {"n": 1}, "wait": 10}
            first = api.post("/v1/tools/echo/calls", json=body, headers={"Idempotency-Key": "hdr-1"})
            again = api.post("/v1/tools/echo/calls", json=body, headers={"Idempotency-Key": "hdr-1"})
            both = api.post("/v1/tools/echo/calls", json={**body, "idempotency_key": "other"},
                            headers={"Idempotency-Key": "hdr-1"})
    finally:
        served.stop()
    assert first.status_code == again.status_code == 200 and first.json()["call_id"] == again.json()["call_id"]
    assert conn.exists(idem("hdr-1")) and len(list(conn.scan_iter(keys.job("*")))) == 1
    assert both.status_code == 400 and "differ" in both.json()["error"]["message"]
