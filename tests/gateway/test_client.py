"""The Gateway client against the real Redis with no worker: submission, refusals, cancel, handles."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from broker import events, keys
from broker.errors import (
    CallCancelled,
    CallFailed,
    CallTimeout,
    InvalidArgs,
    NoWorkers,
    QueueFull,
    UnknownTool,
)
from hermes_gateway.client import Gateway

TRACE, SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TP = f"00-{TRACE}-{SPAN}-01"


@pytest.fixture
def gw(gateway: Gateway, home: Any) -> Gateway:
    home.echo_tool()
    home.sleep_tool()
    home.echo_tool("tiny", queue_size=2, concurrency=1)  # 1 running + 2 waiting, then QueueFull
    gateway.sync_tools()
    return gateway


def test_a_call_is_pending_on_its_queue_with_the_callers_trace(gw: Gateway, conn: Any) -> None:
    h = gw.call_tool("echo", {"x": 1}, traceparent=TP, session_id="s1", tool_call_id="tc1")
    assert conn.lrange(keys.queue("tools"), 0, -1) == [h.call_id.encode()]
    rec = gw.calls.record(h.call_id)
    assert rec["state"] == "pending" and rec["trace_id"] == TRACE
    env = rec["envelope"]
    assert env.args == {"x": 1} and env.traceparent == TP
    assert env.context == {"session_id": "s1", "tool_call_id": "tc1"}
    assert env.tool_version >= 1
    [ev] = events.history(conn, h.call_id)
    assert (ev.state, ev.trace_id, ev.span_id, ev.session_id) == ("pending", TRACE, SPAN, "s1")
    assert not h.done()


def test_without_a_traceparent_a_fresh_valid_trace_starts(gw: Gateway) -> None:
    a, b = gw.call_tool("echo", {}), gw.call_tool("echo", {})
    ta, tb = gw.calls.record(a.call_id)["trace_id"], gw.calls.record(b.call_id)["trace_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", ta) and set(ta) != {"0"}
    assert ta != tb
    tp = gw.calls.record(a.call_id)["envelope"].traceparent
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]", tp)


def test_an_invalid_traceparent_is_replaced_not_propagated(gw: Gateway) -> None:
    h = gw.call_tool("echo", {}, traceparent="00-" + "0" * 32 + "-" + SPAN + "-01")
    assert gw.calls.record(h.call_id)["trace_id"] not in ("", "0" * 32)


def test_an_unknown_tool_is_refused_at_once(gw: Gateway, conn: Any) -> None:
    with pytest.raises(UnknownTool):
        gw.call_tool("no_such_tool", {})
    assert conn.llen(keys.queue("tools")) == 0


def test_bad_arguments_and_unknown_context_are_refused_at_once(gw: Gateway, conn: Any) -> None:
    with pytest.raises(InvalidArgs):
        gw.call_tool("echo", ["not", "a", "mapping"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unknown call context"):
        gw.call_tool("echo", {}, sesion_id="typo")
    # Values the wire cannot carry are the same typed error, in single calls and batches alike.
    from decimal import Decimal

    for bad in ({"d": Decimal("1.5")}, {"o": object()}, {"i": 2**70}):
        with pytest.raises(InvalidArgs, match=r"arguments for 'echo' cannot be sent: cannot encode"):
            gw.call_tool("echo", bad)
        with pytest.raises(InvalidArgs, match="cannot be sent"):
            gw.map("echo", [{"ok": 1}, bad])
    with pytest.raises(InvalidArgs, match="the LLM request cannot be sent"):
        gw.call_llm({"messages": [{"role": "user", "content": Decimal("2")}]})
    with pytest.raises(InvalidArgs, match="messages must be a list of mappings, got str"):
        gw.call_llm({"messages": "hi"})
    with pytest.raises(InvalidArgs, match="needs messages .chat completions. or input"):
        gw.call_llm({"model": "m"})
    with pytest.raises(InvalidArgs, match="model must be text, got list"):
        gw.call_llm({"messages": [], "model": ["x"]})
    # (a model names the call's concurrency key, its metrics and status rows, which every principal sees)
    for model in ("evil}{x}:*model", "a b", "x" * 129, "\nINFO"):
        with pytest.raises(InvalidArgs, match="model .* is not a name"):
            gw.call_llm({"messages": [], "model": model})
    with pytest.raises(InvalidArgs, match="provider .* is not a name"):
        gw.call_llm({"messages": []}, provider="bad provider")
    from hermes_gateway.clientcore import LLM_NAME

    assert LLM_NAME.fullmatch("@cf/meta/llama-3.1-8b-instruct")  # (Workers AI's names begin with @)
    # (the provider merges these as mappings: anything else had failed at the worker as an internal_error)
    for key, value in (("extra_headers", "notadict"), ("extra_body", [1, 2]), ("extra_query", 3)):
        with pytest.raises(InvalidArgs, match=f"{key} must be a mapping"):
            gw.call_llm({"messages": [], key: value})
    for timeout in (-1, 0, float("nan"), "5"):  # (0 had meant the default; -1 failed later as a timeout)
        with pytest.raises(InvalidArgs, match="timeout must be a number of seconds above 0"):
            gw.call_tool("echo", {}, timeout=timeout)
    with pytest.raises(InvalidArgs, match="max_attempts must be an integer of at least 1"):
        gw.call_tool("echo", {}, max_attempts=0)
    for field, value in (("session_id", ["a"]), ("principal", {"x": 1}), ("parent_call_id", object())):
        with pytest.raises(InvalidArgs, match=f"context field {field} must be text"):
            gw.call_tool("echo", {}, **{field: value})
    assert conn.llen(keys.queue("tools")) == 0 and conn.llen(keys.queue("llm")) == 0


def test_a_full_queue_is_queue_full_at_once_never_a_silent_drop(gw: Gateway, conn: Any) -> None:
    for _ in range(3):
        gw.call_tool("tiny", {})
    with pytest.raises(QueueFull) as info:
        gw.call_tool("tiny", {})
    assert info.value.details["limit"] == 2
    assert conn.llen(keys.queue("tools")) == 1  # only the call holding the slot is on the queue
    assert len(gw.router.handles) == 3  # the refused call is not left tracked


def test_map_submits_in_one_go_and_refused_items_raise_on_result(gw: Gateway, conn: Any) -> None:
    handles = gw.map("tiny", [{"i": i} for i in range(5)])
    assert [h.state for h in handles] == ["pending", "pending", "pending", "refused", "refused"]
    with pytest.raises(QueueFull):
        handles[4].result(0)
    assert handles[4].done()
    assert conn.llen(keys.queue("tools")) == 1


def test_a_batch_larger_than_one_pipeline_keeps_order_and_refuses_exactly_the_overflow(
    gw: Gateway, home: Any, conn: Any
) -> None:
    from hermes_gateway.client import SUBMIT_CHUNK

    home.echo_tool("wide", queue_size=SUBMIT_CHUNK + 30, concurrency=1)
    gw.sync_tools()
    n = 2 * SUBMIT_CHUNK + 7  # three pipelines
    handles = gw.map("wide", [{"i": i} for i in range(n)])
    states = [h.state for h in handles]
    accepted = 1 + SUBMIT_CHUNK + 30  # one holds the slot, the rest wait
    assert states == ["pending"] * accepted + ["refused"] * (n - accepted)
    assert len({h.call_id for h in handles}) == n
    assert all(isinstance(h.refused, QueueFull) for h in handles[accepted:])
    assert len(gw.router.handles) == accepted  # refused items are not left tracked


def test_a_broker_failure_mid_batch_refuses_only_the_items_not_yet_sent(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from hermes_gateway.client import SUBMIT_CHUNK

    real = gw._send_chunk
    sent: list[int] = []

    def flaky(chunk: Any) -> list[Any]:
        sent.append(len(chunk))
        if len(sent) == 2:
            raise redis.ConnectionError("broker went away")
        return real(chunk)

    monkeypatch.setattr(gw, "_send_chunk", flaky)
    handles = gw.map("echo", [{"i": i} for i in range(2 * SUBMIT_CHUNK + 1)])
    assert sent == [SUBMIT_CHUNK, SUBMIT_CHUNK], "no pipeline is sent after the broker failed"
    states = [h.state for h in handles]
    assert states == ["pending"] * SUBMIT_CHUNK + ["refused"] * (SUBMIT_CHUNK + 1)
    assert "outcome unknown" in str(handles[SUBMIT_CHUNK].refused)
    assert "broker went away" in str(handles[SUBMIT_CHUNK].refused)
    assert "not sent" in str(handles[-1].refused)
    from broker.errors import BrokerUnavailable

    with pytest.raises(BrokerUnavailable):  # on the first pipeline nothing was accepted: it raises, typed
        monkeypatch.setattr(gw, "_send_chunk", lambda chunk: (_ for _ in ()).throw(redis.ConnectionError("x")))
        gw.map("echo", [{"i": 0}])
    assert len(gw.router.handles) == SUBMIT_CHUNK


def test_an_interrupt_mid_batch_leaves_no_handle_tracked_that_was_not_settled(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hermes_gateway.client import SUBMIT_CHUNK

    real = gw._send_chunk
    calls = []

    def interrupted(chunk: Any) -> list[Any]:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(chunk)

    monkeypatch.setattr(gw, "_send_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gw.map("echo", [{"i": i} for i in range(3 * SUBMIT_CHUNK)])
    assert len(gw.router.handles) == SUBMIT_CHUNK  # the accepted first pipeline's calls are still followed


def test_a_bad_item_refuses_the_whole_batch_before_anything_is_sent(gw: Gateway, conn: Any) -> None:
    with pytest.raises(UnknownTool):
        gw.submit_many([("echo", {"i": 1})] * 150 + [("no_such_tool", {})])
    assert conn.llen(keys.queue("tools")) == 0
    assert gw.router.handles == {}


def test_an_idempotency_key_gives_back_the_existing_call(gw: Gateway, conn: Any) -> None:
    a = gw.call_tool("echo", {"n": 1}, idempotency_key="charge-7")
    b = gw.call_tool("echo", {"n": 1}, idempotency_key="charge-7")  # other args: tests/e2e/test_idempotency.py
    assert b.call_id == a.call_id
    assert conn.llen(keys.queue("tools")) == 1
    a.cancel()
    c = gw.call_tool("echo", {"n": 1}, idempotency_key="charge-7")
    assert c.call_id == a.call_id and not c.own
    assert c.done() and c.final_state == "cancelled"  # its history was read with the resubmission


def test_a_batch_resubmitted_with_its_keys_reads_the_calls_histories_together_and_survives_a_failed_read(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hermes_gateway.clientcore import Router

    first = gw.map("echo", [{"n": i} for i in range(3)], idempotency_keys=[f"b-{i}" for i in range(3)])
    first[0].cancel()
    reads: list[int] = []
    read = Router.read_history

    def counted(pipe: Any, handles: Any) -> None:
        reads.append(len(handles))
        read(pipe, handles)

    monkeypatch.setattr(Router, "read_history", staticmethod(counted))
    again = gw.map("echo", [{"n": i} for i in range(5)], idempotency_keys=[f"b-{i}" for i in range(5)])
    assert [h.call_id for h in again[:3]] == [h.call_id for h in first] and reads == [3]  # one round trip
    assert again[0].final_state == "cancelled"  # (its history was read with the resubmission)

    def broken(pipe: Any, handles: Any) -> None:
        pipe.execute_command("NO-SUCH-COMMAND")  # (the read fails: the broker refuses it)

    monkeypatch.setattr(Router, "read_history", staticmethod(broken))
    third = gw.map("echo", [{"n": i} for i in range(6)], idempotency_keys=[f"b-{i}" for i in range(6)])
    assert [h.call_id for h in third[:5]] == [h.call_id for h in again] and all(h.refused is None for h in third)


def test_result_times_out_when_no_worker_runs_the_call(gw: Gateway) -> None:
    h = gw.call_tool("echo", {})
    with pytest.raises(CallTimeout):
        h.result(timeout=0.2)
    assert gw.calls.record(h.call_id)["state"] == "pending"  # the call itself goes on waiting


def test_cancelling_a_pending_call_ends_it_at_once(gw: Gateway, conn: Any) -> None:
    h = gw.call_tool("sleep", {"seconds": 5}, session_id="s-c")
    assert h.cancel() is True
    assert gw.calls.record(h.call_id)["state"] == "cancelled"
    with pytest.raises(CallCancelled):
        h.result(timeout=5)
    seen = list(h.events(timeout=5))
    assert [e.state for e in seen] == ["pending", "cancelled"]
    assert [e.session_id for e in seen] == ["s-c", "s-c"] and seen[1].span_id  # (the cancel's event too)
    assert conn.zcard(keys.waiting("{tools}", "tool:sleep")) == 0
    assert h.cancel() is False  # already finished
    assert gw.cancel("no-such-call") is False


def test_a_pending_call_a_worker_has_taken_is_cancelled_through_that_worker(gw: Gateway, conn: Any) -> None:
    from broker.codec import unpack

    h = gw.call_tool("sleep", {"seconds": 5})
    assert [c.call_id for c in gw.calls.claim(["tools"], 1, "w1", 30)] == [h.call_id]  # still "pending"
    ps = conn.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(keys.channel(conn, keys.CONTROL_CHANNEL))
    assert h.cancel() is True
    # Its slot stays held until the worker has stopped it: no direct cancel behind the worker's back.
    rec = gw.calls.record(h.call_id)
    assert rec["state"] == "pending" and conn.hget(keys.job(h.call_id), keys.F_CANCEL) == b"1"
    assert conn.zscore(keys.slots("{tools}", "tool:sleep"), h.call_id) is not None
    deadline = time.monotonic() + 5
    msg = None
    while msg is None and time.monotonic() < deadline:
        msg = ps.get_message(timeout=0.2)
    assert msg is not None and unpack(msg["data"]) == {"op": "cancel", "call_id": h.call_id}
    ps.close()


def test_events_arrive_on_the_callers_channel_and_settle_the_handle(gw: Gateway, conn: Any) -> None:
    from broker.calls import CallInfo
    from broker.states import State

    h = gw.call_tool("echo", {"k": "v"})
    rec = gw.calls.record(h.call_id)
    info = CallInfo.of(rec["envelope"], "tool:echo")
    for target in (State.ROUTING, State.EXECUTING, State.FORMATTING):
        gw.calls.transition(info, target, attempt=1)
    gw.calls.transition(info, State.DONE, attempt=1, detail={"result": {"k": "v"}})
    assert h.result(timeout=5) == {"k": "v"}
    assert [e.seq for e in h.events(timeout=1)] == [1, 2, 3, 4, 5]
    assert h.final_state == "done" and h.trace_id == rec["trace_id"]
    assert h.call_id not in gw.router.handles


def test_a_failed_call_raises_its_typed_error(gw: Gateway) -> None:
    from broker.calls import CallInfo
    from broker.states import State

    h = gw.call_tool("echo", {})
    info = CallInfo.of(gw.calls.record(h.call_id)["envelope"], "tool:echo")
    err = {"type": "invalid_args", "message": "city: required", "details": {"path": "city"}}
    gw.calls.transition(info, State.FAILED, attempt=1, detail={"error": err})
    with pytest.raises(InvalidArgs) as exc:
        h.result(timeout=5)
    assert exc.value.details == {"path": "city"}


def test_handle_by_id_of_a_running_call_of_ours_is_the_handle_its_events_feed(gw: Gateway) -> None:
    h = gw.call_tool("sleep", {"seconds": 30})
    assert gw.handle(h.call_id) is h  # (a second handle would only learn of the call's moves by polling)
    h.cancel()
    with pytest.raises(CallCancelled):
        h.result(timeout=5)


def test_handle_by_id_follows_a_call_from_another_client(gw: Gateway, redis_url: str, home: Any) -> None:
    h = gw.call_tool("sleep", {"seconds": 1})
    other = Gateway.connect(redis_url, home=str(home.path), embedded_ok=False)
    try:
        theirs = other.handle(h.call_id)
        assert theirs.state == "pending" and not theirs.own
        h.cancel()
        assert [e.state for e in theirs.events(timeout=5)] == ["pending", "cancelled"]
        with pytest.raises(CallFailed) as info:
            other.handle("no-such-call")
        assert info.value.type == "unknown_call"
    finally:
        other.close()


def test_a_directory_change_by_another_client_is_seen(gw: Gateway, redis_url: str, home: Any) -> None:
    assert gw.tool("echo").spec.timeout == 10
    other = Gateway.connect(redis_url, home=str(home.path), embedded_ok=False)
    try:
        other.register_tool({**gw.tool("echo").spec.to_dict(), "timeout": 3})
    finally:
        other.close()
    deadline = time.monotonic() + 5
    while gw.tool("echo").spec.timeout != 3:
        assert time.monotonic() < deadline, "the change notice never invalidated the cache"
        time.sleep(0.02)


def test_require_workers_says_how_to_start_one(gw: Gateway) -> None:
    assert gw.live_workers("tools") == []
    with pytest.raises(NoWorkers, match="hermes-gateway worker --queues tools"):
        gw.require_workers("tools")


def test_a_call_whose_end_came_only_through_the_history_is_no_longer_tracked(gw: Gateway, conn: Any) -> None:
    """A lost terminal pub/sub message must not keep the handle in the client forever."""
    import dataclasses

    from broker.calls import CallInfo, envelope_of
    from broker.states import State

    h = gw.call_tool("echo", {"x": 1})
    assert h.call_id in gw.router.handles
    env = envelope_of(conn.hget(keys.job(h.call_id), "data"))
    # The terminal event goes to the history and to a channel nobody listens on: "lost" for this client.
    info = dataclasses.replace(CallInfo.of(env, "tool:echo"), channel="hermes:ch:nobody")
    gw.calls.transition(info, State.CANCELLED, attempt=1, current=State.PENDING)
    assert h.call_id in gw.router.handles and not h.done(), "the client has not heard of it"
    h.sync()
    assert h.done() and h.call_id not in gw.router.handles


def test_a_follower_is_woken_by_each_live_event_and_a_result_waiter_by_the_end(
    gw: Gateway, monkeypatch: Any
) -> None:
    import threading

    from broker.calls import CallInfo
    from broker.states import State

    h = gw.call_tool("echo", {"k": "v"})
    # Every event must come from the live feed: a waiter that missed a wake-up would read the history.
    monkeypatch.setattr(h, "sync", lambda: pytest.fail("a waiter was not woken and fell back to the history"))
    seen: list[str] = []
    follower = threading.Thread(target=lambda: seen.extend(e.state for e in h.events(timeout=10)))
    follower.start()
    info = CallInfo.of(gw.calls.record(h.call_id)["envelope"], "tool:echo")
    for target in (State.ROUTING, State.EXECUTING, State.FORMATTING):
        gw.calls.transition(info, target, attempt=1)
        deadline = time.monotonic() + 0.9  # under the follower's 1 s history poll
        while len(seen) < [State.ROUTING, State.EXECUTING, State.FORMATTING].index(target) + 2:
            assert time.monotonic() < deadline, f"the follower did not get {target} from the live feed"
            time.sleep(0.005)
    gw.calls.transition(info, State.DONE, attempt=1, detail={"result": {"k": "v"}})
    assert h.result(timeout=0.9) == {"k": "v"}
    follower.join(5)
    assert seen == ["pending", "routing", "executing", "formatting", "done"]


def _walk_to_done(gw: Gateway, handle: Any) -> None:
    from broker.calls import CallInfo
    from broker.states import State

    info = CallInfo.of(gw.calls.record(handle.call_id)["envelope"], "tool:echo")
    for target in (State.ROUTING, State.EXECUTING, State.FORMATTING):
        gw.calls.transition(info, target, attempt=1)
    gw.calls.transition(info, State.DONE, attempt=1, detail={"result": {"ok": 1}})


@pytest.mark.parametrize("protocol", [2, 3])
def test_events_arrive_over_either_redis_protocol(protocol: int, redis_url: str, home: Any) -> None:
    from broker.config import load_settings
    from broker.connection import BrokerHandle, from_url

    home.echo_tool()
    gw = Gateway(BrokerHandle(from_url(redis_url, protocol=protocol), redis_url, "test"), load_settings(str(home.path)))
    try:
        gw.sync_tools()
        handles = [gw.call_tool("echo", {"i": i}) for i in range(20)]
        for h in handles:
            _walk_to_done(gw, h)
        # Well inside result()'s one-second history read: the events came over pub/sub.
        assert [h.result(timeout=0.9) for h in handles] == [{"ok": 1}] * 20
        assert all(h.state == "done" for h in handles)
    finally:
        gw.close()


def test_a_dropped_subscription_comes_back_and_events_flow_again(gw: Gateway, conn: Any) -> None:
    first = gw.call_tool("echo", {"k": 1})
    _walk_to_done(gw, first)
    assert first.result(timeout=0.9) == {"ok": 1}  # the event thread is reading the subscription directly
    # Only this test's database's subscribers: the server is shared by the other xdist workers' tests, whose
    # workers would lose their control channel (and a stop message sent meanwhile) to a server-wide kill.
    db = conn.connection_pool.connection_kwargs.get("db") or 0
    ours = [c["id"] for c in conn.client_list(_type="pubsub") if int(c["db"]) == db]
    assert ours and all(conn.client_kill_filter(_id=i) == 1 for i in ours)
    deadline = time.monotonic() + 10
    while conn.pubsub_numsub(gw.channel)[0][1] != 1:
        assert time.monotonic() < deadline, "the client did not subscribe again"
        time.sleep(0.05)
    second = gw.call_tool("echo", {"k": 2})
    _walk_to_done(gw, second)
    assert second.result(timeout=0.9) == {"ok": 1}


def test_a_call_cancelled_while_pending_gets_its_audit_record(gw: Gateway, home: Any) -> None:
    from broker.audit import AuditLog

    home.sleep_tool("nap", sensitive=["token"])
    gw.sync_tools()
    h = gw.call_tool("nap", {"seconds": 5, "token": "s3cret-value"}, session_id="s-1", tool_call_id="tc-1")
    assert h.cancel() is True  # no worker: it ends here, pending
    with pytest.raises(CallCancelled):
        h.result(5)
    record = AuditLog(gw.conn).get(h.call_id)
    assert record is not None, "a call cancelled while pending left no audit record"
    assert (record.state, record.kind, record.tool_name, record.session_id) == ("cancelled", "tool", "nap", "s-1")
    assert record.tool_call_id == "tc-1" and record.error_type == "cancelled" and record.attempts == 1
    assert record.args["seconds"] == 5 and "s3cret-value" not in repr(record)
    assert record.trace_id == h.trace_id
    assert h.cancel() is False and len(AuditLog(gw.conn)) == 1  # one record per call, not per cancel


def test_a_call_cancelled_before_any_worker_took_it_is_counted_with_the_others(gw: Gateway, conn: Any) -> None:
    handle = gw.call_tool("echo", {"n": 1})
    assert handle.cancel()
    assert conn.hget(keys.STATS, keys.stats_ended("tool", "echo", "cancelled", "cancelled")) == b"1"
