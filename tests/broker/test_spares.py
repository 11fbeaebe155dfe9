"""Spares: an ending call can lease the next waiting call to its worker without a slot, and the worker's
next ending call moves its slot to that spare; unused spares go back in line at their old places."""

from __future__ import annotations

from typing import Any

import pytest

from broker import keys
from broker.calls import Calls
from broker.errors import QueueFull
from broker.limits import Limits
from broker.records import CallInfo
from broker.states import State
from tests.broker.test_handoff import finish
from tests.broker.test_limits import CKEY, env, queued, submit
from workers import reaper


def members(r: Any, key: str) -> list[str]:
    return [m.decode() for m in r.zrange(key, 0, -1)]


def lined_up(fake: Any, n: int, limit: int, queue_size: int = 10, worker: str = "w1") -> Calls:
    """Calls c0..c{n-1} of one key submitted in order (limit ``limit``), those with a slot claimed by ``worker``."""
    calls = Calls(fake)
    for i in range(n):
        submit(calls, f"c{i}", limit=limit, queue_size=queue_size)
    calls.claim(["tools"], 10, worker, 30)
    return calls


def test_an_ending_call_asking_for_a_spare_leases_the_next_waiting_call_to_the_worker_without_a_slot(
    fake: Any,
) -> None:
    calls = Calls(fake)
    for i in range(4):
        submit(calls, f"c{i}", limit=1)
    score_c2 = fake.zscore(keys.waiting(CKEY), "c2")
    calls.claim(["tools"], 10, "w1", 30)
    reply = finish(calls, "c0", ("w1", 30, "", 1))
    handed, (spare,) = Calls.handed_off(reply), Calls.spared(reply)
    assert handed is not None and handed.call_id == "c1"  # the slot: to the oldest, as before
    assert spare[0].call_id == "c2" and spare[0].attempt == 1 and spare[0].data
    assert float(spare[1]) == score_c2  # its place in line, to go back to
    # c2 is leased to w1 but holds no slot and is still pending; c3 keeps waiting; nothing queued.
    assert members(fake, keys.slots(CKEY)) == ["c1"]
    assert members(fake, keys.waiting(CKEY)) == ["c3"]
    assert fake.zscore(keys.LEASES, "c2") is not None
    assert fake.hmget(keys.job("c2"), "h_state", "h_worker") == [b"pending", b"w1"]
    assert float(fake.hget(keys.job("c2"), "h_spare")) == score_c2
    assert queued(fake) == []


def test_the_next_ending_call_moves_its_slot_to_the_spare_the_worker_already_runs(fake: Any) -> None:
    calls = lined_up(fake, 4, limit=1)
    (spare,) = Calls.spared(finish(calls, "c0", ("w1", 30, "", 1)))
    assert spare[0].call_id == "c2"
    # c1 (handed) ends; the worker has already started its spare c2 on that slot.
    reply = finish(calls, "c1", ("w1", 30, "c2", 0))
    assert Calls.handed_off(reply) is None  # the slot went to the spare, not to c3
    assert Calls.spared(reply) == []  # none asked for
    assert members(fake, keys.slots(CKEY)) == ["c2"]
    assert fake.zscore(keys.slots(CKEY), "c2") != float("inf")  # its lease deadline
    assert fake.hget(keys.job("c2"), "h_spare") is None and fake.hget(keys.job("c2"), "started_at")
    assert members(fake, keys.waiting(CKEY)) == ["c3"]  # still waiting: the limit is 1
    # The spare runs through its states like any call and its end frees the slot for c3.
    info = CallInfo.of(env("c2"), CKEY)
    current = State.PENDING
    for step in (State.ROUTING, State.EXECUTING, State.FORMATTING, State.DONE):
        assert calls.transition(info, step, attempt=1, current=current)[0] > 0
        current = step
    assert members(fake, keys.slots(CKEY)) == ["c3"] and queued(fake) == ["c3"]


def test_a_call_that_is_not_this_workers_spare_does_not_take_the_slot(fake: Any) -> None:
    calls = lined_up(fake, 4, limit=1)
    assert Calls.spared(finish(calls, "c0", ("w1", 30, "", 1))) != []  # c2 spare of w1
    # w2 claims c2 as its spare (it is w1's): refused, and c1's slot goes to the oldest waiting call.
    reply = finish(calls, "c1", ("w2", 30, "c2", 0))
    handed = Calls.handed_off(reply)
    assert handed is not None and handed.call_id == "c3"
    assert members(fake, keys.slots(CKEY)) == ["c3"]
    assert fake.hget(keys.job("c2"), "h_worker") == b"w1" and fake.hget(keys.job("c2"), "h_spare")


def test_spares_given_back_go_back_in_line_at_their_old_places_and_fill_free_slots(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(5):
        submit(calls, f"c{i}", limit=2)
    score_c3 = fake.zscore(keys.waiting(CKEY), "c3")
    claimed = calls.claim(["tools"], 10, "w1", 30)
    assert [c.call_id for c in claimed] == ["c0", "c1"]
    (spare,) = Calls.spared(finish(calls, "c0", ("w1", 30, "", 1)))  # c2 handed, c3 spare
    assert spare[0].call_id == "c3"
    assert members(fake, keys.waiting(CKEY)) == ["c4"]
    assert calls.spares_back("w2", ["c3"]) == []  # not w2's: untouched
    assert fake.zscore(keys.LEASES, "c3") is not None
    assert calls.spares_back("w1", ["c3"]) == []
    # Back in line before c4 (its old place), no longer leased nor w1's; no slot was free, nothing queued.
    assert members(fake, keys.waiting(CKEY)) == ["c3", "c4"]
    assert fake.zscore(keys.waiting(CKEY), "c3") == score_c3
    assert fake.zscore(keys.LEASES, "c3") is None
    assert fake.hmget(keys.job("c3"), "h_spare", "h_worker") == [None, None]
    assert queued(fake) == []
    assert calls.spares_back("w1", ["c3"]) == []  # twice: no effect
    assert members(fake, keys.waiting(CKEY)) == ["c3", "c4"]
    # A slot frees up: the oldest (c3) gets it, through the queue.
    end_ = finish(calls, "c1", None)
    assert int(end_[0]) > 0
    assert queued(fake) == ["c3"]


def test_a_spare_given_back_that_was_free_to_run_goes_straight_onto_the_queue(fake: Any) -> None:
    calls = lined_up(fake, 4, limit=1)
    assert Calls.spared(finish(calls, "c0", ("w1", 30, "", 1))) != []  # c1 handed, c2 spare
    finish(calls, "c1", None)  # c1's slot goes to c3 through the queue (c2 is out of line)
    assert queued(fake) == ["c3"]
    calls.claim(["tools"], 10, "w2", 30)
    finish(calls, "c3", None)  # nobody waits: the slot is free
    assert fake.zcard(keys.slots(CKEY)) == 0
    assert calls.spares_back("w1", ["c2"]) == []
    assert queued(fake) == ["c2"] and members(fake, keys.slots(CKEY)) == ["c2"]


def test_a_spare_cancelled_meanwhile_is_left_out_for_the_worker_to_end(fake: Any) -> None:
    calls = lined_up(fake, 3, limit=1)
    assert Calls.spared(finish(calls, "c0", ("w1", 30, "", 1))) != []  # c2 spare of w1
    fake.hset(keys.job("c2"), keys.F_CANCEL, "1")  # what a caller's cancel does to a leased pending call
    assert calls.spares_back("w1", ["c2"]) == ["c2"]
    assert members(fake, keys.waiting(CKEY)) == [] and members(fake, keys.spared(CKEY)) == []
    assert fake.zscore(keys.LEASES, "c2") == 0  # expired at once: if the worker does not end it, the reaper does
    reaper.end_cancelled(calls, "c2", 60)
    assert fake.hget(keys.job("c2"), "h_state") == b"cancelled"
    assert fake.zscore(keys.LEASES, "c2") is None


def test_a_cancelled_spare_the_worker_failed_to_end_is_ended_by_the_reaper(fake: Any) -> None:
    calls = lined_up(fake, 3, limit=1)
    assert Calls.spared(finish(calls, "c0", ("w1", 30, "", 1))) != []  # c2 spare of w1
    fake.hset(keys.job("c2"), keys.F_CANCEL, "1")
    assert calls.spares_back("w1", ["c2"]) == ["c2"]  # ... and the worker died before ending it
    assert reaper.reap(calls, lease=10, result_ttl=60) == 1
    assert fake.hget(keys.job("c2"), "h_state") == b"cancelled"


def test_the_reaper_puts_a_dead_workers_spare_back_in_line_not_on_the_queue(fake: Any) -> None:
    calls = lined_up(fake, 4, limit=1, worker="dead")
    assert Calls.spared(finish(calls, "c0", ("dead", 30, "", 1))) != []  # c1 handed, c2 spare
    # The worker died: every lease of it runs out (c1 never started: it keeps its slot, back on the queue).
    fake.zadd(keys.LEASES, {"c1": 1, "c2": 1})
    assert reaper.reap(calls, lease=10, result_ttl=60) == 2
    assert members(fake, keys.waiting(CKEY)) == ["c2", "c3"]  # c2 at its old place, before c3
    assert queued(fake) == ["c1"]
    assert members(fake, keys.slots(CKEY)) == ["c1"]
    assert fake.zscore(keys.LEASES, "c2") is None and fake.hget(keys.job("c2"), "h_state") == b"pending"


def test_the_reaper_ends_a_dead_workers_spare_its_caller_cancelled(fake: Any) -> None:
    calls = lined_up(fake, 3, limit=1, worker="dead")
    assert Calls.spared(finish(calls, "c0", ("dead", 30, "", 1))) != []  # c2 spare
    fake.hset(keys.job("c2"), keys.F_CANCEL, "1")
    fake.zadd(keys.LEASES, {"c2": 1})
    assert reaper.reap(calls, lease=10, result_ttl=60) == 1
    assert fake.hget(keys.job("c2"), "h_state") == b"cancelled"
    assert members(fake, keys.waiting(CKEY)) == [] and fake.zscore(keys.LEASES, "c2") is None


def test_spares_still_count_as_waiting_for_the_queue_size(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(4):  # c0 runs; c1..c3 wait: the queue (size 3) is full
        submit(calls, f"c{i}", limit=1, queue_size=3)
    with pytest.raises(QueueFull):
        submit(calls, "extra", limit=1, queue_size=3)
    calls.claim(["tools"], 10, "w1", 30)
    assert Calls.spared(finish(calls, "c0", ("w1", 30, "", 1))) != []  # c1 handed, c2 spare
    assert members(fake, keys.waiting(CKEY)) == ["c3"] and members(fake, keys.spared(CKEY)) == ["c2"]
    submit(calls, "c4", limit=1, queue_size=3)  # c2, c3, c4 wait
    with pytest.raises(QueueFull) as e:
        submit(calls, "c5", limit=1, queue_size=3)
    assert e.value.details == {"key": CKEY, "limit": 3, "depth": 3}
    assert Limits(fake).snapshot() == [{"key": CKEY, "limit": 1, "running": 1, "waiting": 3}]
    # Once the spare runs on a slot (or goes back in line) it is counted where it is.
    finish(calls, "c1", ("w1", 30, "c2", 0))
    assert members(fake, keys.spared(CKEY)) == [] and members(fake, keys.slots(CKEY)) == ["c2"]
    submit(calls, "c5", limit=1, queue_size=3)


def test_the_sweep_drops_the_spare_mark_of_a_call_whose_record_is_gone(fake: Any) -> None:
    calls = lined_up(fake, 3, limit=1)
    assert Calls.spared(finish(calls, "c0", ("w1", 30, "", 1))) != []  # c2 spare
    fake.delete(keys.job("c2"))
    Limits(fake).sweep(grace=0)
    assert members(fake, keys.spared(CKEY)) == []


def test_a_workers_oldest_spare_gets_its_next_freed_slot_before_any_younger_waiting_call(fake: Any) -> None:
    calls = lined_up(fake, 6, limit=2)  # c0, c1 run
    reply = finish(calls, "c0", ("w1", 30, "", 1))  # c2 handed, c3 spare (reply not read yet, say)
    assert Calls.spared(reply) != []
    # c1 ends without naming a spare: its slot goes to w1's spare c3, not to c4 (younger, waiting).
    handed = Calls.handed_off(finish(calls, "c1", ("w1", 30, "", 0)))
    assert handed is not None and handed.call_id == "c3" and handed.data
    assert members(fake, keys.slots(CKEY)) == ["c2", "c3"] and members(fake, keys.spared(CKEY)) == []
    assert fake.hget(keys.job("c3"), "h_spare") is None
    assert members(fake, keys.waiting(CKEY)) == ["c4", "c5"]


def test_another_workers_spare_or_an_older_waiting_call_is_not_taken_as_ones_own_spare(fake: Any) -> None:
    calls = lined_up(fake, 6, limit=2)
    assert Calls.spared(finish(calls, "c0", ("w1", 30, "", 1))) != []  # c2 handed, c3 spare of w1
    handed = Calls.handed_off(finish(calls, "c1", ("w2", 30, "", 0)))  # w2 gets the waiting head
    assert handed is not None and handed.call_id == "c4"
    assert members(fake, keys.spared(CKEY)) == ["c3"]
    # Work handed back goes first (score 0): older than w1's spare, so it gets w1's next slot.
    fake.zadd(keys.waiting(CKEY), {"c5": 0})
    handed = Calls.handed_off(finish(calls, "c2", ("w1", 30, "", 0)))
    assert handed is not None and handed.call_id == "c5"
    assert members(fake, keys.spared(CKEY)) == ["c3"]


def test_free_slots_of_a_raised_limit_go_to_the_oldest_waiting_calls_before_any_spare_is_taken(fake: Any) -> None:
    calls = lined_up(fake, 8, limit=2, queue_size=50)  # c0, c1 run
    fake.hset(keys.LIMITS, CKEY, 5)  # raised: three more slots free
    reply = finish(calls, "c0", ("w1", 30, "", 2))
    assert Calls.handed_off(reply).call_id == "c2"  # type: ignore[union-attr]
    assert queued(fake) == ["c3", "c4", "c5"]  # the free slots, in line
    assert [c.call_id for c, _ in Calls.spared(reply)] == ["c6", "c7"]  # spares only from what still waits


def test_a_workers_own_spare_is_not_handed_a_slot_over_a_lowered_limit(fake: Any) -> None:
    calls = lined_up(fake, 8, limit=3, queue_size=50)  # c0 c1 c2 run
    reply = finish(calls, "c0", ("w1", 30, "", 2))  # c3 handed, c4 c5 spares
    assert [c.call_id for c, _ in Calls.spared(reply)] == ["c4", "c5"]
    fake.hset(keys.LIMITS, CKEY, 1)  # lowered: 3 held, 1 allowed
    assert Calls.handed_off(finish(calls, "c1", ("w1", 30, "", 0))) is None
    assert Calls.handed_off(finish(calls, "c2", ("w1", 30, "", 0))) is None
    assert members(fake, keys.slots(CKEY)) == ["c3"]
    assert members(fake, keys.spared(CKEY)) == ["c4", "c5"]  # still waiting, as spares


def test_a_spare_cancelled_straight_away_by_its_caller_loses_its_mark(fake: Any) -> None:
    calls = lined_up(fake, 3, limit=1, queue_size=50)
    assert Calls.spared(finish(calls, "c0", ("w1", 30, "", 1))) != []  # c2 spare
    # A caller that saw c2 pending and not leased (just before it became a spare) cancels it directly.
    info = CallInfo.of(env("c2"), CKEY)
    assert calls.transition(info, State.CANCELLED, attempt=1, fence=False, from_states=frozenset({State.PENDING}))[0] > 0
    assert members(fake, keys.spared(CKEY)) == [] and fake.hget(keys.job("c2"), "h_spare") is None
    assert Limits(fake).snapshot()[0]["waiting"] == 0


def test_the_sweep_drops_marks_of_calls_that_are_no_longer_pending_spares(fake: Any) -> None:
    calls = lined_up(fake, 4, limit=1, queue_size=50)
    assert len(Calls.spared(finish(calls, "c0", ("w1", 30, "", 2)))) == 2  # c2, c3 spares
    fake.hset(keys.job("c2"), "h_state", "failed")  # ended by some path that did not clear its mark
    fake.hdel(keys.job("c3"), "h_spare")
    Limits(fake).sweep(grace=0)
    assert members(fake, keys.spared(CKEY)) == []


def test_requeue_unstarted_puts_a_call_holding_its_slot_back_at_the_head_and_nothing_else(fake: Any) -> None:
    calls = lined_up(fake, 3, limit=1, queue_size=50)  # c0 leased, holding the slot
    assert calls.requeue_unstarted("c1", CKEY, "tools") == 0  # waiting, no slot: untouched
    assert calls.requeue_unstarted("c0", CKEY, "tools") == 1
    assert queued(fake) == ["c0"] and fake.zscore(keys.LEASES, "c0") is None
    assert fake.zscore(keys.slots(CKEY), "c0") == float("inf")
    assert members(fake, keys.waiting(CKEY)) == ["c1", "c2"]


def test_a_caller_cancels_directly_only_a_call_no_worker_holds(fake: Any) -> None:
    calls = lined_up(fake, 4, limit=1, queue_size=50)
    assert Calls.spared(finish(calls, "c0", ("w1", 30, "", 1))) != []  # c2 became w1's spare
    pending = frozenset({State.PENDING})

    def cancel(cid: str) -> int:
        info = CallInfo.of(env(cid), CKEY)
        return int(calls.transition(info, State.CANCELLED, attempt=1, fence=False, from_states=pending, unleased=True)[0])

    # The caller saw c2 pending and unleased a moment ago; now it is w1's: refused, the worker is told instead.
    assert cancel("c2") == -3
    assert fake.hget(keys.job("c2"), "h_state") == b"pending" and members(fake, keys.spared(CKEY)) == ["c2"]
    assert cancel("c3") > 0  # still waiting, held by nobody: cancelled here and now
    assert fake.hget(keys.job("c3"), "h_state") == b"cancelled"
