"""Hand-off: an ending call's slot goes straight to the oldest waiting call of its queue, leased to the worker."""

from __future__ import annotations

from typing import Any

from broker import keys
from broker.calls import Calls
from broker.records import CallInfo
from broker.states import State
from tests.broker.test_limits import CKEY, env, queued, submit


def finish(calls: Calls, cid: str, handoff: tuple[str, float] | tuple[str, float, str, int] | None) -> Any:
    info = CallInfo.of(env(cid), CKEY)
    current = State.PENDING
    for step in (State.ROUTING, State.EXECUTING, State.FORMATTING):
        assert calls.transition(info, step, attempt=1, current=current)[0] > 0
        current = step
    return calls.transition(info, State.DONE, attempt=1, current=current, handoff=handoff)


def test_ending_with_handoff_leases_the_oldest_waiting_call_to_the_worker_without_queueing_it(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(3):
        submit(calls, f"c{i}", limit=1)
    assert [c.call_id for c in calls.claim(["tools"], 10, "w1", 30)] == ["c0"]
    reply = finish(calls, "c0", ("w1", 30))
    handed = Calls.handed_off(reply)
    assert handed is not None and handed.call_id == "c1" and handed.attempt == 1 and handed.data
    assert queued(fake) == []  # not pushed: nobody else can claim it
    assert fake.hget(keys.job("c1"), "h_worker") == b"w1"
    assert fake.zscore(keys.LEASES, "c1") is not None
    # The slot is still held (limit 1), now with the lease deadline instead of +inf; c2 keeps waiting.
    assert [m.decode() for m in fake.zrange(keys.slots(CKEY), 0, -1)] == ["c1"]
    assert fake.zscore(keys.slots(CKEY), "c1") != float("inf")
    assert [m.decode() for m in fake.zrange(keys.waiting(CKEY), 0, -1)] == ["c2"]


def test_without_handoff_or_waiters_the_slot_is_promoted_onto_the_queue_as_before(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(2):
        submit(calls, f"c{i}", limit=1)
    calls.claim(["tools"], 10, "w1", 30)
    assert Calls.handed_off(finish(calls, "c0", None)) is None
    assert queued(fake) == ["c1"]
    calls.claim(["tools"], 10, "w1", 30)
    assert Calls.handed_off(finish(calls, "c1", ("w1", 30))) is None  # nobody waits
    assert fake.zcard(keys.slots(CKEY)) == 0
