"""The client core both clients stand on: typed options, a handle's state, routing by call id (no I/O);
and the asyncio face keeps the sync one's promise that a refused batch leaves no handle behind."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from broker import events, keys
from broker.calls import step_text
from broker.codec import pack
from broker.errors import CallCancelled, ExecutorError, InvalidArgs, QueueFull
from broker.events import Event
from hermes_gateway.aio import AsyncGateway
from hermes_gateway.clientcore import CallOptions, CallState, Router, Steps, await_steps, run_steps


def event(call_id: str, seq: int, state: str, **detail: Any) -> Event:
    return events.decode(wire(call_id, seq, state, **detail))


def wire(call_id: str, seq: int, state: str, **detail: Any) -> bytes:
    return pack({"call_id": call_id, "seq": seq, "state": state, "type": events.TRANSITION, "detail": detail})


def test_batch_options_are_taken_from_the_common_keywords_and_the_rest_is_context() -> None:
    common: dict[str, Any] = {"timeout": 5, "queue": "q", "session_id": "s-1", "call_class": "batch"}
    opts = CallOptions.take(common)
    assert (opts.timeout, opts.queue, opts.call_class) == (5, "q", "batch")
    assert common == {"session_id": "s-1"}
    assert opts.item(["k0", None], 0).idempotency_key == "k0"
    assert opts.item(["k0", None], 1) is opts and opts.item(None, 3) is opts
    with pytest.raises(InvalidArgs, match="call_class"):
        CallOptions(call_class="urgent").envelope_options()


def test_one_operation_runs_alike_on_both_faces_and_handles_a_failed_command_where_it_was_sent() -> None:
    def command(reply: Any, fail: bool = False) -> Any:  # a blocking client's reply
        if fail:
            raise ConnectionError("down")
        return reply

    async def acommand(reply: Any, fail: bool = False) -> Any:  # an asyncio client's awaitable
        return command(reply, fail)

    def operation(send: Any) -> Steps[list[Any]]:
        got = [(yield send(1))]
        try:
            yield send(None, fail=True)
        except ConnectionError as e:
            got.append(str(e))
        got.append((yield send(2)))
        return got

    assert run_steps(operation(command)) == [1, "down", 2]
    assert asyncio.run(await_steps(operation(acommand))) == [1, "down", 2]


def test_a_handle_takes_each_event_once_in_order_and_its_end_stops_its_routing() -> None:
    router: Router[CallState] = Router()
    h = router.track(CallState(router, "c1", "echo"))
    assert events.for_handle(router.handles, wire("nobody", 1, "pending")) is None
    _, routed, gap = events.for_handle(router.handles, wire("c1", 2, "executing"))  # type: ignore[misc]
    assert routed is h and gap  # seq 1 was never heard: the face reads the history first
    h.feed(event("c1", 1, "pending"))
    h.feed(event("c1", 1, "pending"))
    h.feed(event("c1", 2, "executing"))
    seen = h.seen
    assert [e.seq for e in seen] == [1, 2] and h.state == "executing" and not h.done()
    h.feed(event("c1", 3, "done", result={"ok": 1}))
    assert [e.seq for e in seen] == [1, 2] and [e.seq for e in h.seen] == [1, 2, 3]  # (a copy each time)
    assert h.done() and h.final_state == "done" and h.outcome() == {"ok": 1}
    assert router.handles == {} and router.get("c1") is None  # nothing kept without keep_ended


def test_a_handle_whose_feed_lagged_past_the_end_still_lists_every_transition() -> None:
    """Its history read after the call ended is the kept end alone: the moves between come from its steps."""
    router: Router[CallState] = Router()
    h = router.track(CallState(router, "c1", "echo"))
    h.feed(event("c1", 1, "pending"))
    moves = (("pending", 9.0), ("routing", 9.5), ("executing", 9.75), ("formatting", 9.875))
    steps = "#1" + "".join(step_text(s, 1, t, i) for i, (s, t) in enumerate(moves))  # (one write from seq 1)
    h.feed(events.decode(pack({"call_id": "c1", "seq": 5, "state": "done", "ts": 10.0, "detail": {"result": 1}, "steps": steps})))
    assert [(e.seq, e.state, e.ts) for e in h._events[1:]] == [(2, "routing", 9.5), (3, "executing", 9.75), (4, "formatting", 9.875), (5, "done", 10.0)]
    assert h.outcome() == 1
    # Steps written before they named their seqs (a record from before): numbered into the gap.
    old = CallState(router, "c2", "echo")
    old.feed(event("c2", 1, "pending"))
    legacy = "".join(f"{s[0]}1 {round(t * 1e6):x};" for s, t in moves)
    old.feed(events.decode(pack({"call_id": "c2", "seq": 5, "state": "done", "ts": 10.0, "detail": {}, "steps": legacy})))
    assert [(e.seq, e.state) for e in old._events] == [(1, "pending"), (2, "routing"), (3, "executing"), (4, "formatting"), (5, "done")]


def test_an_ended_handle_is_kept_for_lookup_only_with_keep_ended_and_errors_stay_typed() -> None:
    router: Router[CallState] = Router(keep_ended=1)
    a, b = (router.track(CallState(router, c, "echo")) for c in ("a", "b"))
    a.feed(event("a", 1, "failed", error={"type": "executor_error", "message": "boom"}))
    b.feed(event("b", 1, "cancelled", error={"message": "stopped"}))
    assert router.get("b") is b and router.get("a") is None  # one kept: the latest
    with pytest.raises(ExecutorError, match="boom"):
        a.outcome()
    with pytest.raises(CallCancelled, match="stopped"):
        b.outcome()
    c = router.track(CallState(router, "c", "echo"))
    c.refuse(QueueFull("full"))
    assert c.done() and c.state == "refused" and router.waiting() == []
    with pytest.raises(QueueFull):
        c.outcome()


def test_a_bad_item_refuses_the_whole_async_batch_and_leaves_nothing_tracked(
    redis_url: str, home: Any, gateway: Any, conn: Any
) -> None:
    home.echo_tool()
    gateway.sync_tools()

    async def scenario() -> dict[str, Any]:
        async with await AsyncGateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False) as gw:
            with pytest.raises(InvalidArgs):
                await gw.map("echo", [{"i": 1}] * 3 + ["not a mapping"])  # type: ignore[list-item]
            return dict(gw.router.handles)

    assert asyncio.run(scenario()) == {}
    assert conn.llen(keys.queue("tools")) == 0


def test_a_gap_the_history_cannot_fill_holds_back_all_but_a_terminal_event() -> None:
    import redis

    from hermes_gateway.clientcore import ClientCore

    class Unreachable(CallState):
        def sync(self, live_grace: float = 0.0) -> Any:
            raise redis.ConnectionError("broker down")

    router: Router[CallState] = Router()
    h = router.track(Unreachable(router, "c1", "echo"))
    later, end = event("c1", 3, "executing"), event("c1", 4, "done", result=1)
    # (a later re-read lists the held-back event after the ones it missed; the end is known now)
    assert run_steps(ClientCore._fill_gap(h, later)) is False
    assert run_steps(ClientCore._fill_gap(h, end)) is True
    reachable = router.track(CallState(router, "c2", "echo"))
    reachable.sync = lambda live_grace=0.0: None  # type: ignore[method-assign]
    assert run_steps(ClientCore._fill_gap(reachable, event("c2", 3, "executing"))) is True
