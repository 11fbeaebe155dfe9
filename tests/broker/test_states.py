"""The call state machine: exactly the documented transitions are legal, and the Lua scripts agree."""

from __future__ import annotations

import itertools

import fakeredis
import pytest
from rq.job import JobStatus

from broker import keys
from broker.calls import MISSING, WRONG_STATE, CallInfo, Calls
from broker.errors import IllegalTransition
from broker.states import ACTIVE, RQ_STATUS, TERMINAL, TRANSITIONS, State, sources

P, RO, EX, FO, DO, FA, RE, CA = (
    "pending",
    "routing",
    "executing",
    "formatting",
    "done",
    "failed",
    "retrying",
    "cancelled",
)

# Written out from DESIGN.md (not copied from the code): the main road, failure and cancel from any
# live state, retry from a running state, and back to pending from retrying.
LEGAL = {
    (P, RO), (P, FA), (P, CA),
    (RO, EX), (RO, FA), (RO, CA), (RO, RE),
    (EX, FO), (EX, FA), (EX, CA), (EX, RE),
    (FO, DO), (FO, FA), (FO, CA), (FO, RE),
    (RE, P), (RE, FA), (RE, CA),
}  # fmt: skip

ALL = [s.value for s in State]
PAIRS = list(itertools.product(ALL, ALL))


def test_the_states_are_the_documented_ones() -> None:
    assert set(ALL) == {P, RO, EX, FO, DO, FA, RE, CA}
    assert TERMINAL == {State.DONE, State.FAILED, State.CANCELLED}
    assert ACTIVE == {State.ROUTING, State.EXECUTING, State.FORMATTING}


@pytest.mark.parametrize(("current", "target"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_every_pair_is_legal_exactly_when_documented(current: str, target: str) -> None:
    assert (State(target) in TRANSITIONS[State(current)]) == ((current, target) in LEGAL)
    if (current, target) not in LEGAL:
        r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
        with pytest.raises(IllegalTransition) as info:
            Calls(r).transition(_info(), State(target), attempt=1, current=State(current))
        assert info.value.details == {"current": current, "target": target}


@pytest.mark.parametrize("state", sorted(TERMINAL))
def test_terminal_states_have_no_exits(state: State) -> None:
    assert TRANSITIONS[state] == frozenset()
    assert all(state not in sources(State(target)) for target in ALL)


def test_sources_is_the_inverse_of_the_table() -> None:
    for target in State:
        assert sources(target) == {State(a) for a, b in LEGAL if b == target}


def test_every_state_is_reachable_from_pending_and_every_live_state_can_end() -> None:
    seen, todo = {State.PENDING}, [State.PENDING]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(State)
    for state in set(State) - TERMINAL:
        assert {State.FAILED, State.CANCELLED} <= TRANSITIONS[state]


def test_each_state_maps_to_a_real_rq_status() -> None:
    rq_statuses = {s.value for s in JobStatus}
    assert set(RQ_STATUS) == set(State)
    assert set(RQ_STATUS.values()) <= rq_statuses
    assert RQ_STATUS[State.PENDING] == "queued"
    assert RQ_STATUS[State.DONE] == "finished"


def _info() -> CallInfo:
    return CallInfo("c1", "ab" * 16, "cd" * 8, "tool", "echo", None, "hermes:ch:t", "tool:echo", "tools")


@pytest.mark.parametrize(("current", "target"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_the_transition_script_enforces_the_same_table(current: str, target: str) -> None:
    # The Lua script is what guards Redis; it must refuse exactly what the table refuses.
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    r.hset(keys.job("c1"), mapping={keys.F_STATE: current, keys.F_ATTEMPT: 1, keys.F_SEQ: 3})
    calls = Calls(r)
    seq, before = calls.transition(_info(), State(target), attempt=1)
    assert before == current.encode()
    state_after = r.hget(keys.job("c1"), keys.F_STATE).decode()
    if (current, target) in LEGAL:
        assert seq == 4
        assert state_after == target
        assert r.hget(keys.job("c1"), "status").decode() == RQ_STATUS[State(target)]
    else:
        assert seq == WRONG_STATE
        assert state_after == current
        assert r.llen(keys.history("c1")) == 0


@pytest.mark.parametrize(("current", "target"), [(a, b) for a, b in PAIRS if (a, b) not in LEGAL])
def test_the_client_refuses_an_illegal_move_before_touching_redis(current: str, target: str) -> None:
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    with pytest.raises(IllegalTransition):
        Calls(r).transition(_info(), State(target), attempt=1, current=State(current))
    assert r.dbsize() == 0


def test_a_missing_call_cannot_move() -> None:
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    assert Calls(r).transition(_info(), State.ROUTING, attempt=1)[0] == MISSING
