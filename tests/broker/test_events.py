"""Events: one per transition, seq rising by one, durable history, CAS refusals, late followers."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest

from broker import events, keys
from broker.calls import FENCED, MISSING, WRONG_STATE, CallInfo, Calls
from broker.envelope import Envelope
from broker.errors import DecodeError
from broker.states import State

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TP = f"00-{TRACE}-{SPAN}-01"
CHANNEL = "hermes:ch:client1"

# DESIGN.md: {call_id, seq, state, ts, trace_id, span_id, attempt, kind, tool_name | model, session_id, detail}
DESIGN_FIELDS = {
    "call_id",
    "seq",
    "state",
    "ts",
    "trace_id",
    "span_id",
    "attempt",
    "kind",
    "session_id",
    "detail",
}
# Our one addition: ``type`` tells transitions from progress messages and stream deltas.


def submit(calls: Calls, call_id: str = "c1", **env_kw: Any) -> CallInfo:
    env = Envelope(
        call_id=call_id,
        kind=env_kw.pop("kind", "tool"),
        tool=env_kw.pop("tool", "echo"),
        args={},
        traceparent=TP,
        channel=env_kw.pop("channel", CHANNEL),
        context={"session_id": "sess-1"},
        **env_kw,
    )
    accepted, cid = Calls.check_submit(
        calls.submit(env, ckey="tool:echo", queue_size=-1, max_attempts=3, timeout=5), "tool:echo", -1
    )
    assert accepted and cid == call_id
    return CallInfo.of(env, "tool:echo")


def raw_history(r: Any, call_id: str = "c1") -> list[dict[str, Any]]:
    return [msgpack.unpackb(b, raw=False) for b in r.lrange(keys.history(call_id), 0, -1)]


def walk(calls: Calls, info: CallInfo, states: list[State], attempt: int = 1) -> None:
    for target in states:
        seq, _ = calls.transition(info, target, attempt=attempt)
        assert seq > 0, f"{target} refused: {seq}"


HAPPY = [State.ROUTING, State.EXECUTING, State.FORMATTING, State.DONE]


def published(ps: Any) -> list[bytes]:
    """Every message waiting on a pubsub (subscribe confirmations skipped)."""
    out = []
    while (msg := ps.get_message(timeout=0.01)) is not None:
        if msg["type"] == "message":
            out.append(msg["data"])
    return out


def test_seq_rises_by_one_per_event_and_history_keeps_the_order(fake: Any) -> None:
    calls = Calls(fake)
    info = submit(calls)
    walk(calls, info, HAPPY[:-1])
    hist = events.history(fake, "c1")
    assert [e.seq for e in hist] == [1, 2, 3, 4]
    assert [e.state for e in hist] == ["pending", "routing", "executing", "formatting"]
    assert [e.ts for e in hist] == sorted(e.ts for e in hist)
    assert int(fake.hget(keys.job("c1"), keys.F_SEQ)) == 4
    assert not any(e.terminal for e in hist)
    assert [e.seq for e in events.history(fake, "c1", 3)] == [3, 4]


def test_an_ended_calls_history_is_its_terminal_event_alone(fake: Any) -> None:
    calls = Calls(fake)
    info = submit(calls)
    walk(calls, info, HAPPY)
    (end,) = events.history(fake, "c1")
    assert (end.seq, end.state) == (5, "done") and end.terminal
    assert fake.type(keys.ended("c1")) == b"string" and not fake.exists(keys.history("c1"))
    # A reader that saw some events before the end gets the end next, and nothing once it has it.
    for seen in range(5):
        assert [e.seq for e in events.history(fake, "c1", seen + 1)] == [5]
    assert events.history(fake, "c1", 6) == []
    rec = calls.record("c1")
    assert (rec["state"], rec["seq"], rec["trace_id"]) == ("done", 5, TRACE)
    assert rec["ended_at"] and rec["envelope"] is None and rec["request_dropped"]


@pytest.mark.parametrize("call_id", ["c1", "{tools}." + "ab" * 16, "x" * 300])
def test_an_ended_calls_kept_event_leaves_its_id_to_the_key_and_readers_put_it_back(fake: Any, call_id: str) -> None:
    calls = Calls(fake)
    info = submit(calls, call_id)
    walk(calls, info, HAPPY)
    assert raw_history(fake, call_id) == []  # the list is gone: the end is kept as a string
    kept = msgpack.unpackb(fake.get(keys.ended(call_id)), raw=False)
    # A short id (fixstr) and a long one (str8) are left out; one past 255 bytes is kept as it is.
    assert ("call_id" in kept) == (len(call_id) > 255)
    assert kept["state"] == "done" and kept["seq"] == 5 and kept["steps"]
    (end,) = events.history(fake, call_id)
    assert (end.call_id, end.state, end.seq, end.trace_id) == (call_id, "done", 5, TRACE)
    assert [s[0] for s in end.steps] == ["pending", "routing", "executing", "formatting"]
    assert calls.record(call_id)["state"] == "done"
    if len(call_id) <= 255:
        with pytest.raises(DecodeError):  # read without its key, it names no call
            events.decode(fake.get(keys.ended(call_id)))


def test_the_event_carries_exactly_the_documented_fields(fake: Any) -> None:
    calls = Calls(fake)
    info = submit(calls)
    walk(calls, info, [State.ROUTING])
    for raw in raw_history(fake):
        # DESIGN.md's `tool_name | model`: the one the kind has; `type` only on a progress or delta event.
        assert set(raw) == DESIGN_FIELDS | {"tool_name"}
        assert raw["call_id"] == "c1"
        assert raw["trace_id"] == TRACE
        assert raw["kind"] == "tool" and raw["tool_name"] == "echo"
        assert raw["session_id"] == "sess-1"
        assert raw["attempt"] == 1
        assert isinstance(raw["ts"], float) and abs(raw["ts"] - time.time()) < 60
        assert isinstance(raw["detail"], dict)
        assert events.decode(msgpack.packb(raw)).type == events.TRANSITION
    assert raw_history(fake)[0]["span_id"] == SPAN  # the pending event names the caller's span


def test_an_llm_event_names_the_model_not_a_tool(fake: Any) -> None:
    data = events.payload(
        call_id="c9",
        state="pending",
        trace_id=TRACE,
        span_id=SPAN,
        attempt=1,
        kind="llm",
        name="gpt-x",
        session_id=None,
    )
    raw = msgpack.unpackb(data, raw=False)
    assert raw["model"] == "gpt-x" and "tool_name" not in raw
    event = events.decode(events_with_seq(data))
    assert (event.model, event.tool_name, event.type) == ("gpt-x", None, events.TRANSITION)


def events_with_seq(data: bytes) -> bytes:
    return msgpack.packb(msgpack.unpackb(data, raw=False) | {"seq": 1})


def test_a_progress_event_says_its_type() -> None:
    data = events.payload(
        call_id="c9", state="executing", trace_id=TRACE, span_id=SPAN, attempt=1, kind="tool", name="t",
        session_id=None, type=events.PROGRESS, detail={"message": "5 rows"},
    )  # fmt: skip
    assert msgpack.unpackb(data, raw=False)["type"] == events.PROGRESS
    assert events.decode(events_with_seq(data)).type == events.PROGRESS


def test_the_payload_is_a_fixmap_so_lua_can_append_seq() -> None:
    data = events.payload(
        call_id="c", state="x", trace_id="", span_id="", attempt=1, kind="tool", name="t", session_id=None,
        detail={"k": list(range(100))},
    )  # fmt: skip
    assert 0x80 <= data[0] <= 0x8F - 1  # room for one more key


@pytest.mark.parametrize("start", [120, 250, 65_530, 16_777_210])
def test_seq_is_encoded_correctly_past_each_msgpack_width(fake: Any, start: int) -> None:
    calls = Calls(fake)
    info = submit(calls)
    fake.hset(keys.job("c1"), keys.F_SEQ, start)
    fake.delete(keys.history("c1"))
    for _ in range(12):  # progress events do not change the state, so any number may follow
        calls.transition(info, None, attempt=1, event_type=events.PROGRESS, detail={"message": "m"})
    seqs = [e.seq for e in events.history(fake, "c1", 1)]
    assert seqs == list(range(start + 1, start + 13))


def test_progress_events_keep_the_state_and_still_count(fake: Any) -> None:
    calls = Calls(fake)
    info = submit(calls)
    walk(calls, info, [State.ROUTING, State.EXECUTING])
    seq, before = calls.transition(
        info,
        None,
        attempt=1,
        event_type=events.PROGRESS,
        detail={"message": "5 rows"},
        current=State.EXECUTING,
    )
    assert seq == 4 and before == b"executing"
    ev = events.history(fake, "c1")[-1]
    assert ev.type == events.PROGRESS and ev.state == "executing" and ev.detail == {"message": "5 rows"}
    assert not ev.terminal
    assert fake.hget(keys.job("c1"), keys.F_STATE) == b"executing"


def test_with_keep_history_an_ended_call_keeps_every_event_and_its_whole_record(fake: Any) -> None:
    calls = Calls(fake)
    calls.keep_history = True  # (workers.keep_history)
    info = submit(calls)
    walk(calls, info, HAPPY)
    assert [e.seq for e in events.history(fake, "c1")] == [1, 2, 3, 4, 5]
    assert fake.hget(keys.job("c1"), "data") and fake.hget(keys.job("c1"), keys.F_CHANNEL) == CHANNEL.encode()
    assert 0 < fake.ttl(keys.job("c1")) <= 3600 and 0 < fake.ttl(keys.history("c1")) <= 3600
    assert calls.record("c1")["ended_at"]


def test_each_event_is_published_on_the_callers_channel(fake: Any) -> None:
    ps = fake.pubsub()
    ps.subscribe(CHANNEL)
    calls = Calls(fake)
    info = submit(calls)
    walk(calls, info, HAPPY)
    got = published(ps)
    assert len(got) == 5
    assert [events.decode(b).seq for b in got] == [1, 2, 3, 4, 5]
    (kept,) = events.history(fake, "c1")  # an ended call keeps its last event (with its earlier steps)
    assert kept.to_dict() == events.decode(got[-1]).to_dict() | {"steps": kept.steps}
    ps.close()


def _unchanged(r: Any) -> tuple[Any, ...]:
    return (
        r.hget(keys.job("c1"), keys.F_STATE),
        r.hget(keys.job("c1"), keys.F_SEQ),
        r.llen(keys.history("c1")),
    )


def test_refusals_have_distinct_codes_and_change_nothing(fake: Any) -> None:
    calls = Calls(fake)
    ps = fake.pubsub()
    ps.subscribe(CHANNEL)
    ghost = CallInfo("nope", TRACE, SPAN, "tool", "echo", None, CHANNEL, "tool:echo", "tools")
    assert calls.transition(ghost, State.ROUTING, attempt=1)[0] == MISSING == -1
    assert not fake.exists(keys.job("nope")) and not fake.exists(keys.history("nope"))

    info = submit(calls)
    assert len(published(ps)) == 1  # the pending event
    before = _unchanged(fake)
    seq, state = calls.transition(info, State.ROUTING, attempt=2)  # a worker holding an old lease
    assert (seq, state) == (FENCED, b"pending") and FENCED == -2
    assert _unchanged(fake) == before
    seq, state = calls.transition(info, State.FORMATTING, attempt=1)  # pending -> formatting skips steps
    assert (seq, state) == (WRONG_STATE, b"pending") and WRONG_STATE == -3
    assert _unchanged(fake) == before
    assert published(ps) == []
    ps.close()


def test_no_transition_leaves_a_terminal_state(fake: Any) -> None:
    calls = Calls(fake)
    info = submit(calls)
    walk(calls, info, HAPPY)
    for target in State:
        assert calls.transition(info, target, attempt=1)[0] == WRONG_STATE
    # Not even a progress event, nor an unfenced write from outside.
    assert calls.transition(info, None, attempt=1, event_type=events.PROGRESS)[0] == WRONG_STATE
    assert calls.transition(info, State.CANCELLED, attempt=1, fence=False)[0] == WRONG_STATE
    assert [(e.seq, e.state) for e in events.history(fake, "c1")] == [(5, "done")]


def test_terminal_transitions_drop_the_lease_and_set_a_ttl(fake: Any) -> None:
    calls = Calls(fake)
    info = submit(calls)
    fake.zadd(keys.leases("{tools}"), {"c1": time.time() + 30})
    walk(calls, info, [State.ROUTING, State.FAILED])
    assert fake.zscore(keys.leases("{tools}"), "c1") is None
    assert 0 < fake.ttl(keys.job("c1")) <= 3600  # (the default result TTL)
    assert 0 < fake.ttl(keys.ended("c1")) <= 3600 and not fake.exists(keys.history("c1"))
    assert calls.record("c1")["ended_at"]


# -- follow(): late subscribers ------------------------------------------------------------------


def test_follow_after_the_end_gives_the_moves_rebuilt_then_the_terminal_event_once(fake: Any) -> None:
    """The ended call keeps its end alone: a follower from the start gets the moves rebuilt from its steps
    (as a handle does), then the end; one that saw them all gets nothing."""
    calls = Calls(fake)
    info = submit(calls)
    walk(calls, info, HAPPY)
    got = list(events.follow(fake, "c1", timeout=1))
    assert [(e.seq, e.state) for e in got] == list(enumerate(["pending", "routing", "executing", "formatting", "done"], 1))
    assert [e.span_id for e in got[1:4]] == ["", "", ""] and {e.trace_id for e in got} == {info.trace_id}
    assert list(events.follow(fake, "c1", timeout=1, after=5)) == []


def test_follow_joins_late_then_tails_live_filling_a_dropped_message(fake: Any) -> None:
    calls = Calls(fake)
    info = submit(calls)
    walk(calls, info, [State.ROUTING, State.EXECUTING])
    stream = events.follow(fake, "c1", timeout=5, poll=0.05)

    got = [next(stream) for _ in range(3)]  # history: subscribed by now
    assert [e.seq for e in got] == [1, 2, 3]

    fake.publish(CHANNEL, fake.lindex(keys.history("c1"), 1))  # an old event again: must not repeat
    calls.transition(
        info, None, attempt=1, event_type=events.PROGRESS, detail={"message": "half"}, current=State.EXECUTING
    )  # seq 4
    lost = CallInfo(**{**info.__dict__, "channel": "hermes:ch:elsewhere"})
    calls.transition(lost, State.FORMATTING, attempt=1)  # seq 5: stored, never reaches the follower
    calls.transition(
        info, None, attempt=1, event_type=events.PROGRESS, detail={"message": "late"}, current=State.FORMATTING
    )  # seq 6: published, shows the gap (filled from the history while the call still runs)
    got += [next(stream) for _ in range(3)]
    calls.transition(info, State.DONE, attempt=1)  # seq 7

    got += list(stream)
    assert [e.seq for e in got] == [1, 2, 3, 4, 5, 6, 7]
    assert [e.state for e in got] == ["pending", "routing", "executing", "executing", "formatting", "formatting", "done"]
    assert got[3].type == events.PROGRESS


@pytest.mark.parametrize(("after", "rest"), [(0, [1, 2, 3, 6, 7]), (3, [6, 7]), (4, [6, 7]), (5, [6, 7]), (6, [7])])
def test_a_follower_resuming_after_the_end_gets_exactly_the_moves_after_its_seq(
    fake: Any, after: int, rest: list[int]
) -> None:
    """Progress events leave gaps once the history is trimmed: each kept step names its seq, so a
    follower resuming after seq N (Last-Event-ID, ``after=``) misses no move and gets none twice."""
    calls = Calls(fake)
    info = submit(calls)
    walk(calls, info, [State.ROUTING, State.EXECUTING])  # seqs 2, 3
    for message in ("half", "most"):  # seqs 4, 5
        calls.transition(info, None, attempt=1, event_type=events.PROGRESS, detail={"message": message},
                         current=State.EXECUTING)  # fmt: skip
    walk(calls, info, [State.FORMATTING, State.DONE])  # seqs 6, 7 (the end trims the history)
    got = list(events.follow(fake, "c1", timeout=1, after=after))
    assert [e.seq for e in got] == rest
    states = {1: "pending", 2: "routing", 3: "executing", 6: "formatting", 7: "done"}
    assert [e.state for e in got] == [states[n] for n in rest]


def test_steps_written_by_batched_moves_name_each_moves_seq(fake: Any) -> None:
    """A worker's moves joined into one write (``via``) get their seqs from the write's first one."""
    calls = Calls(fake)
    info = submit(calls)
    now = time.time()
    moves = [(State.ROUTING, None, now), (State.EXECUTING, None, now), (State.FORMATTING, None, now)]
    calls.move(info, State.DONE, attempt=1, current=State.PENDING, via=moves, ttl=60)
    (end,) = events.history(fake, "c1")
    assert [(s[0], s[3]) for s in end.steps] == [("pending", 1), ("routing", 2), ("executing", 3), ("formatting", 4)]
    assert end.seq == 5


def test_follow_reads_a_dropped_terminal_event_from_history_when_quiet(fake: Any) -> None:
    calls = Calls(fake)
    info = submit(calls)
    stream = events.follow(fake, "c1", timeout=5, poll=0.02)
    assert next(stream).seq == 1
    lost = CallInfo(**{**info.__dict__, "channel": "hermes:ch:elsewhere"})
    walk(calls, lost, HAPPY)  # nothing of it is published to the follower, and it ended meanwhile
    rest = list(stream)  # the moves it missed, rebuilt from the kept end's steps, then the end
    assert [(e.seq, e.state) for e in rest] == [(2, "routing"), (3, "executing"), (4, "formatting"), (5, "done")]
    assert [e.span_id for e in rest[:-1]] == ["", "", ""] and rest[-1].span_id == info.span_id


def test_follow_ignores_other_calls_on_a_shared_channel(fake: Any) -> None:
    calls = Calls(fake)
    info = submit(calls, "c1")
    other = submit(calls, "c2")
    stream = events.follow(fake, "c1", timeout=5, poll=0.05)
    assert next(stream).seq == 1
    walk(calls, other, HAPPY)
    walk(calls, info, HAPPY[:-1])
    rest = [next(stream) for _ in range(3)]
    walk(calls, info, HAPPY[-1:])
    rest += list(stream)
    assert {e.call_id for e in rest} == {"c1"}
    assert [e.seq for e in rest] == [2, 3, 4, 5]  # (the live tail: each published event once)


def test_follow_stops_at_its_timeout_without_a_terminal_event(fake: Any) -> None:
    calls = Calls(fake)
    submit(calls)
    assert [e.seq for e in events.follow(fake, "c1", timeout=0.1, poll=0.02)] == [1]


def test_follow_of_an_unknown_call_is_empty(fake: Any) -> None:
    assert list(events.follow(fake, "missing", timeout=0.1)) == []


# -- moves written together (a worker's outbox joins a call's moves made before it sends them) ------


def test_moves_written_together_keep_their_own_events_in_order(fake: Any) -> None:
    calls = Calls(fake)
    ps = fake.pubsub()
    ps.subscribe(CHANNEL)
    info = submit(calls)
    published(ps)
    seq, before = calls.transition(
        info,
        State.EXECUTING,
        attempt=1,
        current=State.PENDING,
        via=[(State.ROUTING, {"worker": "w1"}, 1000.0)],
        ts=1001.0,
    )
    assert (seq, before) == (3, b"pending")
    hist = raw_history(fake)
    assert [(e["seq"], e["state"]) for e in hist] == [(1, "pending"), (2, "routing"), (3, "executing")]
    assert (hist[1]["ts"], hist[1]["detail"], hist[2]["ts"]) == (1000.0, {"worker": "w1"}, 1001.0)
    assert [msgpack.unpackb(b)["state"] for b in published(ps)] == ["routing", "executing"]
    assert calls.record("c1")["state"] == "executing"
    # A terminal move with one before it: both events, the fields, the slot released as when alone.
    seq, _ = calls.transition(
        info,
        State.DONE,
        attempt=1,
        current=State.EXECUTING,
        via=[(State.FORMATTING, None, 1002.0)],
        fields={keys.F_RESULT: b"\x81\xa1k\xa1v"},
        detail={"result": {"k": "v"}},
    )
    assert seq == 5
    assert [msgpack.unpackb(b)["state"] for b in published(ps)] == ["formatting", "done"]
    assert [e.state for e in events.history(fake, "c1")] == ["done"]
    rec = calls.record("c1")
    assert (rec["state"], rec["result"]) == ("done", {"k": "v"})
    assert fake.ttl(keys.job("c1")) > 0
    ps.close()


def test_moves_written_together_are_checked_move_by_move(fake: Any) -> None:
    from broker.errors import IllegalTransition

    calls = Calls(fake)
    info = submit(calls)
    with pytest.raises(IllegalTransition):  # routing -> done skips a step, even inside a joined write
        calls.transition(info, State.EXECUTING, attempt=1, current=State.PENDING, via=[(State.DONE, None, 1.0)])
    with pytest.raises(ValueError):  # earlier moves need a state change to ride with
        calls.transition(info, None, attempt=1, via=[(State.ROUTING, None, 1.0)])
    before = _unchanged(fake)
    # Redis holds "pending": a first move from "routing" is refused as a whole, nothing written.
    seq, state = calls.transition(info, State.FORMATTING, attempt=1, via=[(State.EXECUTING, None, 1.0)])
    assert (seq, state) == (WRONG_STATE, b"pending")
    assert _unchanged(fake) == before


def test_a_decoded_event_is_the_same_frozen_value_the_constructor_builds(fake: Any) -> None:
    import dataclasses

    calls = Calls(fake)
    submit(calls)
    (decoded,) = events.history(fake, "c1")
    built = events.Event(
        call_id="c1",
        seq=1,
        state="pending",
        ts=decoded.ts,
        trace_id=TRACE,
        span_id=SPAN,
        attempt=1,
        kind="tool",
        tool_name="echo",
        session_id="sess-1",
        detail=decoded.detail,
    )
    assert decoded == built and repr(decoded) == repr(built)
    assert dataclasses.replace(decoded, seq=2).seq == 2 and decoded.terminal is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.seq = 9  # type: ignore[misc]


@pytest.mark.parametrize("broker", ["conn", "fake"])
def test_an_ended_call_keeps_its_earlier_transitions_as_steps_before_its_end(broker: str, request: Any) -> None:
    """The terminal event an ended call keeps names every earlier transition (written alone or joined
    to the end), with its attempt and how long before the end it was: what the console's waterfall
    draws once the rest of the history is gone (Redis and fakeredis alike: the script parses nothing)."""
    r = request.getfixturevalue(broker)
    calls = Calls(r)
    info = submit(calls)
    t0 = time.time()
    calls.move(info, State.ROUTING, attempt=1, current=State.PENDING, ts=t0 + 1.0)
    calls.move(
        info,
        State.DONE,
        attempt=1,
        current=State.ROUTING,
        via=[(State.EXECUTING, None, t0 + 1.5), (State.FORMATTING, None, t0 + 1.75)],
        ts=t0 + 2.0,
        ttl=60,
    )
    (kept,) = events.history(r, "c1")
    assert kept.state == "done"
    assert kept.steps is not None
    assert [(s[0], s[1]) for s in kept.steps] == [("pending", 1), ("routing", 1), ("executing", 1), ("formatting", 1)]
    befores = [s[2] for s in kept.steps]
    assert befores[0] >= 2_000_000  # submitted before t0
    assert befores[1:] == [1_000_000, 500_000, 250_000]


@pytest.mark.parametrize("broker", ["conn", "fake"])
def test_a_follower_whose_feed_lagged_gets_the_moves_it_missed_back_from_the_kept_end(broker: str, request: Any) -> None:
    """A caller saw the submission live, then read the history only after the call had ended (its feed
    lagged behind): the history is the end alone, and ``missed_moves`` rebuilds the transitions between
    from its steps, numbered into the gap, in order, with the end's trace id."""
    r = request.getfixturevalue(broker)
    calls = Calls(r)
    info = submit(calls)
    seen = events.history(r, "c1")
    assert [e.state for e in seen] == ["pending"]
    t0 = time.time()
    calls.move(info, State.ROUTING, attempt=1, current=State.PENDING, ts=t0 + 1.0)
    calls.move(info, State.EXECUTING, attempt=1, current=State.ROUTING, ts=t0 + 1.5)
    calls.move(info, State.FORMATTING, attempt=1, current=State.EXECUTING, ts=t0 + 1.75)
    calls.move(info, State.DONE, attempt=1, current=State.FORMATTING, ts=t0 + 2.0, ttl=60)
    (end,) = events.history(r, "c1", seen[-1].seq + 1)
    missed = events.missed_moves(end, seen[-1].seq, 1)
    assert [(e.state, e.attempt, e.seq) for e in missed] == [("routing", 1, 2), ("executing", 1, 3), ("formatting", 1, 4)]
    assert [round(e.ts - t0, 3) for e in missed] == [1.0, 1.5, 1.75]
    assert {e.trace_id for e in missed} == {end.trace_id} and end.seq == 5
    assert events.missed_moves(end, missed[-1].seq, 4) == []  # nothing missed, nothing made up
