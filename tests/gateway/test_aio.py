"""The asyncio client against a real Redis and real worker processes: calls, events, batches, cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from broker import events
from broker.audit import AuditLog
from broker.errors import CallCancelled, CallFailed, InvalidArgs, QueueFull, UnknownTool
from hermes_gateway.aio import AsyncGateway
from tests.conftest import Home
from tests.llm_server import LLMServer

Scenario = Callable[[AsyncGateway], Awaitable[Any]]


def run(redis_url: str, home: Home, scenario: Scenario, check_workers: bool = True) -> Any:
    """Run ``scenario`` with a connected AsyncGateway in a fresh event loop (one per test); calls to a queue
    no worker listens on wait for one with ``check_workers=False`` (else they raise NoWorkers)."""

    async def main() -> Any:
        async with await AsyncGateway.connect(
            redis_url, home=str(home.path), embedded_ok=False, check_workers=check_workers
        ) as gw:
            return await asyncio.wait_for(scenario(gw), 30)

    return asyncio.run(main())


@pytest.fixture
def tools(home: Home, gateway: Any) -> None:
    """echo and sleep in the directory (through the threaded client: one directory for both)."""
    home.echo_tool()
    home.sleep_tool()
    gateway.sync_tools()


def transitions(evs: list[events.Event]) -> list[str]:
    return [e.state for e in evs if e.type == events.TRANSITION]


def test_call_tool_result_and_events_in_order_with_the_context_carried(
    redis_url: str, home: Home, tools: None, workers: Any, conn: Any
) -> None:
    workers()

    async def scenario(gw: AsyncGateway) -> Any:
        handle = await gw.call_tool("echo", {"x": 1}, session_id="s-1", tool_call_id="tc-1", turn_id="t-1")
        evs = [ev async for ev in handle.events(timeout=20)]
        return handle, evs, await handle.result(5)

    handle, evs, result = run(redis_url, home, scenario)
    assert result == {"x": 1}
    assert transitions(evs) == ["pending", "routing", "executing", "formatting", "done"]
    assert [e.seq for e in evs] == list(range(1, len(evs) + 1))
    assert handle.final_state == "done"
    assert {e.session_id for e in evs} == {"s-1"}
    # (An ended call keeps no envelope: its audit record has the context the worker ran it with.)
    audited = AuditLog(conn).get(handle.call_id)
    assert audited is not None
    assert (audited.session_id, audited.tool_call_id, audited.turn_id) == ("s-1", "tc-1", "t-1")


def test_many_calls_awaited_together_and_a_batch_in_one_round_trip(
    redis_url: str, home: Home, tools: None, workers: Any
) -> None:
    workers(concurrency=32)

    async def scenario(gw: AsyncGateway) -> Any:
        singles = [await gw.call_tool("echo", {"i": i}) for i in range(20)]
        batch = await gw.map("echo", ({"i": i} for i in range(200)))
        mixed = await gw.submit_many([("echo", {"a": 1}), ("sleep", {"seconds": 0})], session_id="s-b")
        got = await asyncio.gather(*(h.result(20) for h in [*singles, *batch, *mixed]))
        return batch, got

    batch, got = run(redis_url, home, scenario)
    assert len(batch.accepted) == 200 and batch.refused == []
    assert got[:220] == [{"i": i} for i in range(20)] + [{"i": i} for i in range(200)]
    assert got[220] == {"a": 1} and got[221] == {"slept": 0}


def test_more_calls_gathered_at_once_than_the_client_has_connections_all_run(
    redis_url: str, home: Home, tools: None, workers: Any
) -> None:
    """redis-py's asyncio pool refuses its 101st connection at once ("Too many connections"): 400 calls
    submitted together each held one while sent, and ~300 failed with BrokerUnavailable, Redis healthy."""
    from broker.connection import ASYNC_CONNECTIONS

    workers(concurrency=32)

    async def one(gw: AsyncGateway, i: int) -> Any:
        return await (await gw.call_tool("echo", {"i": i})).result(25)

    async def scenario(gw: AsyncGateway) -> Any:
        return await asyncio.gather(*(one(gw, i) for i in range(4 * ASYNC_CONNECTIONS)))

    got = run(redis_url, home, scenario)
    assert got == [{"i": i} for i in range(4 * ASYNC_CONNECTIONS)]


def test_a_full_queue_refuses_batch_items_and_single_calls_at_once(
    redis_url: str, home: Home, gateway: Any
) -> None:
    home.echo_tool("tight", concurrency=1, queue_size=2)
    gateway.sync_tools()  # no workers: nothing leaves the queue

    async def scenario(gw: AsyncGateway) -> Any:
        batch = await gw.map("tight", [{"i": i} for i in range(5)])
        with pytest.raises(QueueFull):
            await gw.call_tool("tight", {"i": 9})
        with pytest.raises(UnknownTool):
            await gw.call_tool("nope", {})
        with pytest.raises(QueueFull):
            await batch[-1].result(1)
        return batch

    batch = run(redis_url, home, scenario, check_workers=False)
    assert len(batch.accepted) == 3 and [i for i, _ in batch.refused] == [3, 4]
    assert all(isinstance(h.refused, QueueFull) for _, h in batch.refused)


def test_cancel_a_waiting_call_and_a_running_one(
    redis_url: str, home: Home, tools: None, workers: Any
) -> None:
    async def waiting(gw: AsyncGateway) -> Any:
        handle = await gw.call_tool("sleep", {"seconds": 5})  # no worker yet: it waits
        assert await handle.cancel() is True
        with pytest.raises(CallCancelled):
            await handle.result(10)
        assert await handle.cancel() is False  # already over
        return transitions([ev async for ev in handle.events(timeout=5)])

    assert run(redis_url, home, waiting, check_workers=False) == ["pending", "cancelled"]

    workers()

    async def running(gw: AsyncGateway) -> Any:
        handle = await gw.call_tool("sleep", {"seconds": 20})
        async for ev in handle.events(timeout=20):
            if ev.state == "executing":
                assert await handle.cancel() is True
        with pytest.raises(CallCancelled):
            await handle.result(10)
        return handle.final_state

    assert run(redis_url, home, running) == "cancelled"


def test_call_llm_streams_deltas_as_events_and_returns_the_completion(
    redis_url: str, home: Home, workers: Any
) -> None:
    with LLMServer() as llm:
        home.config({"model": {"provider": "openai-compatible", "base_url": llm.base_url, "model": "m"}})
        workers(queues="llm")

        async def scenario(gw: AsyncGateway) -> Any:
            ask = [{"role": "user", "content": "Reply exactly hello from asyncio"}]
            handle = await gw.call_llm({"messages": ask, "stream": True}, session_id="s-llm")
            deltas = [
                ev.detail.get("content", "") async for ev in handle.events(20) if ev.type == events.DELTA
            ]
            return deltas, await handle.result(5)

        deltas, result = run(redis_url, home, scenario)
    assert "".join(deltas) == "hello from asyncio" and len(deltas) > 1
    assert result["choices"][0]["message"]["content"] == "hello from asyncio"


def test_failures_are_typed_and_an_idempotent_resubmission_follows_the_first_call(
    redis_url: str, home: Home, gateway: Any, workers: Any
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    home.echo_tool("strict", input_schema=schema)
    gateway.sync_tools()
    workers()

    async def scenario(gw: AsyncGateway) -> Any:
        bad = await gw.call_tool("strict", {"n": "not a number"})
        with pytest.raises(CallFailed) as info:
            await bad.result(20)
        first = await gw.call_tool("strict", {"n": 1}, idempotency_key="k-1")
        again = await gw.call_tool("strict", {"n": 1}, idempotency_key="k-1")
        other = await gw.handle(first.call_id)
        return info.value, first, again, await again.result(20), await other.result(20)

    error, first, again, result, followed = run(redis_url, home, scenario)
    assert isinstance(error, InvalidArgs) and error.type == "invalid_args"
    assert again.call_id == first.call_id  # (the handle of ours its events feed while it runs, else its own)
    assert result == followed == {"n": 1}


def test_a_call_cancelled_while_pending_gets_its_audit_record(redis_url: str, home: Home, gateway: Any) -> None:
    from broker.audit import AuditLog

    home.sleep_tool("nap", sensitive=["token"])
    gateway.sync_tools()

    async def scenario(gw: AsyncGateway) -> Any:
        handle = await gw.call_tool("nap", {"seconds": 5, "token": "s3cret-value"}, session_id="s-9", principal="ops")
        assert await handle.cancel() is True  # no worker: it ends here, pending
        return handle.call_id

    call_id = run(redis_url, home, scenario, check_workers=False)
    record = AuditLog(gateway.conn).get(call_id)
    assert record is not None, "a call cancelled while pending left no audit record"
    assert (record.state, record.kind, record.tool_name) == ("cancelled", "tool", "nap")
    assert (record.session_id, record.principal, record.error_type) == ("s-9", "ops", "cancelled")
    assert record.args["seconds"] == 5 and "s3cret-value" not in repr(record)
    assert record.trace_id == gateway.calls.record(call_id)["trace_id"]


def test_the_directory_writes_policy_and_worker_checks_are_there_awaited(
    redis_url: str, home: Home, gateway: Any, workers: Any
) -> None:
    """The README: the asyncio client has the same calls, awaited (these go through a threaded client)."""
    from broker.errors import NoWorkers

    workers(1, queues="tools")

    async def scenario(gw: AsyncGateway) -> Any:
        version = await gw.register_tool({"name": "aecho", "executor": "python", "function": "workers.executors.builtin:echo"})
        assert (await gw.tool("aecho")).version == version
        assert "aecho" in [t["function"]["name"] for t in await gw.tool_schemas()]
        assert (await gw.policy()) is not None
        assert [w for w in await gw.live_workers("tools")]
        await gw.require_workers("tools")
        with pytest.raises(NoWorkers):
            await gw.require_workers("nobody-listens-here")
        return await (await gw.call_tool("aecho", {"x": 1})).result(10)

    assert run(redis_url, home, scenario) == {"x": 1}


def test_close_ends_the_waits_of_calls_in_flight_and_refuses_new_calls(
    redis_url: str, home: Home, tools: None, workers: Any
) -> None:
    from broker.errors import GatewayClosed

    workers(concurrency=4)

    async def main() -> Any:
        gw = await AsyncGateway.connect(redis_url, home=str(home.path), embedded_ok=False)
        handle = await gw.call_tool("sleep", {"seconds": 3})
        waiting = asyncio.ensure_future(handle.result())
        await asyncio.sleep(0.2)
        await gw.close()
        with pytest.raises(GatewayClosed, match="goes on without this client"):
            await asyncio.wait_for(waiting, 2)  # (it polled the closed connection, reopened, for 3 s)
        with pytest.raises(GatewayClosed, match="sends no more calls"):
            await gw.call_tool("echo", {"x": 1})
        await gw.close()  # (twice: nothing more)
        return handle.call_id

    call_id = asyncio.run(main())
    from broker.config import load_settings
    from broker.connection import from_url
    from hermes_gateway import Gateway
    from hermes_gateway.client import BrokerHandle

    with Gateway(BrokerHandle(from_url(redis_url), redis_url, redis_url), load_settings(home.path)) as gw:
        assert gw.handle(call_id).result(10) == {"slept": 3}  # the call went on without the closed client
        gw.close()
        with pytest.raises(GatewayClosed):
            gw.call_tool("echo", {"x": 1})


def test_500_calls_of_other_clients_followed_live_leave_no_subscription_or_handle_behind(
    redis_url: str, home: Home, tools: None, gateway: Any, workers: Any, conn: Any
) -> None:
    from hermes_gateway.client import Gateway

    with Gateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False) as second:
        ids = [h.call_id for gw in (gateway, second) for h in gw.map("echo", [{"i": i} for i in range(250)])]
        channels = [gateway.channel, second.channel]  # (each submitter's: the followed calls share them)

        async def follow(gw: AsyncGateway, call_id: str) -> list[int]:
            return [ev.seq async for ev in (await gw.handle(call_id)).events(timeout=60)]

        async def scenario(gw: AsyncGateway) -> Any:
            before = dict(gw._pubsub.channels)
            followers = [asyncio.ensure_future(follow(gw, call_id)) for call_id in ids]
            while sum(gw._follows.values()) < len(ids):  # every call followed: now they may run
                await asyncio.sleep(0.05)
            assert sorted(gw._follows) == sorted(channels) and len(gw.router.handles) == len(ids)
            await asyncio.to_thread(workers)
            seqs = await asyncio.gather(*followers)
            while gw._pubsub.channels != before:  # (forgotten as each unsubscription is confirmed)
                await asyncio.sleep(0.05)
            return seqs, gw.router.handles, gw._follows, set(gw._confirmed) & set(channels), len(gw._foreign)

        seqs, routed, follows, confirmed, foreign = run(redis_url, home, scenario, check_workers=False)
        assert all(s == list(range(1, len(s) + 1)) and len(s) == 5 for s in seqs)
        assert routed == {} and not follows and not confirmed and foreign == 0
        assert [n for _, n in conn.pubsub_numsub(*channels)] == [1, 1]  # their submitters alone


def test_following_an_idempotent_resubmission_of_a_running_call_of_ours_keeps_our_subscription(
    redis_url: str, home: Home, tools: None, gateway: Any, workers: Any
) -> None:
    home.tool("chatty", function="tests.e2e.mcptools:chatty", timeout=20)
    gateway.sync_tools()
    workers()

    async def scenario(gw: AsyncGateway) -> Any:
        first = await gw.call_tool("sleep", {"seconds": 0.3}, idempotency_key="k-run")
        again = await gw.call_tool("sleep", {"seconds": 0.3}, idempotency_key="k-run")
        followed = [ev.seq async for ev in again.events(timeout=20)]
        later = await gw.call_tool("chatty", {"n": 300})  # (its last events are heard live, or lost)
        return first, again, followed, [ev.seq async for ev in later.events(timeout=20)]

    first, again, followed, seqs = run(redis_url, home, scenario)
    assert seqs == list(range(1, 306)), "our own channel was unsubscribed"
    assert again is first and followed == [1, 2, 3, 4, 5]  # (the handle the events feed)
