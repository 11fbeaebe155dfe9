"""A worker's spares: how many it asks for, the oldest first, unused ones given back, none while stopping."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker import keys
from broker.calls import Calls
from broker.config import Settings
from broker.errors import HermesError
from broker.records import CallInfo, Claimed
from broker.states import State
from tests.broker.test_handoff import finish
from tests.broker.test_limits import CKEY, env, submit
from workers import retry as retry_mod
from workers import spares as spares_mod
from workers.runner import Running
from workers.spares import ASK_MAX, SPARE_MIN_HELD, SPARES_MAX, Spares
from workers.worker import Worker


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def worker(fake: Any, tmp_path: Any) -> Iterator[Callable[[int], Worker]]:
    """``worker(concurrency)``: a Worker named w-a on ``fake`` (not started), closed after the test."""
    made: list[Worker] = []

    def make(concurrency: int) -> Worker:
        w = Worker(fake, Settings(home=tmp_path, lease=5.0, result_ttl=600), ["tools"], concurrency=concurrency, name="w-a")
        made.append(w)
        return w

    yield make
    for w in made:
        w.core.close()
        w.pool.shutdown()


def leased_spares(fake: Any, calls: Calls, worker: str, n: int) -> list[tuple[Claimed, bytes]]:
    """``n`` spares leased to ``worker`` by real ending transitions (limit 1: c0 runs, the next is handed)."""
    for i in range(2 * n + 2):  # each ending: one call handed the slot, one more as a spare
        submit(calls, f"c{i}", limit=1, queue_size=50)
    calls.claim(["tools"], 10, worker, 30)
    out = []
    running = "c0"
    for _ in range(n):
        reply = finish(calls, running, (worker, 30, "", 1))
        handed = Calls.handed_off(reply)
        assert handed is not None
        running = handed.call_id
        (spare,) = Calls.spared(reply)
        out.append(spare)
    return out


def held_spare(fake: Any, w: Worker) -> tuple[Claimed, bytes]:
    """One spare leased to worker ``w`` (named w-a) and held by its ``Spares``."""
    (spare,) = leased_spares(fake, w.core.calls, "w-a", 1)
    w.spares.received(CKEY, 1, [spare])
    return spare

def cancelled_spare(fake: Any) -> tuple[Spares, str, list[list[str]]]:
    """One spare held by worker w1's ``Spares`` whose caller asked for a cancel (``h_cancel``, what the
    caller's cancel writes before telling the worker); (the spares, its call id, the ids it ended)."""
    calls = Calls(fake)
    ended: list[list[str]] = []
    sp = Spares(calls, "w1", ended.append)
    (spare,) = leased_spares(fake, calls, "w1", 1)
    sp.received(CKEY, 1, [spare])
    fake.hset(keys.job(spare[0].call_id), keys.F_CANCEL, "1")
    return sp, spare[0].call_id, ended


def test_a_worker_asks_for_spares_by_how_many_calls_of_the_key_it_runs(fake: Any) -> None:
    sp = Spares(Calls(fake), "w1", lambda ids: None)
    assert sp.take(CKEY, SPARE_MIN_HELD - 1) == (None, 0)  # too few calls running here: none
    asks = [sp.take(CKEY, 3 * SPARE_MIN_HELD)[1] for _ in range(4)]
    assert asks == [ASK_MAX, 1, 0, 0]  # three wanted, at most two a write; replies not read yet: no more
    sp.received(CKEY, ASK_MAX, [])  # a reply without spares (nobody waits)
    assert sp.take(CKEY, 3 * SPARE_MIN_HELD)[1] == ASK_MAX
    many = [sp.take("tool:other", 1000)[1] for _ in range(SPARES_MAX)]
    assert sum(many) == SPARES_MAX and max(many) == ASK_MAX
    assert sp.take(CKEY, 1000, may_ask=False) == (None, 0)


def test_one_ending_call_can_lease_several_spares_oldest_first(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(6):
        submit(calls, f"c{i}", limit=1, queue_size=50)
    calls.claim(["tools"], 10, "w1", 30)
    reply = finish(calls, "c0", ("w1", 30, "", 3))
    assert [c.call_id for c, _ in Calls.spared(reply)] == ["c2", "c3", "c4"]
    sp = Spares(calls, "w1", lambda ids: None)
    sp.take(CKEY, 9)
    sp.received(CKEY, 2, Calls.spared(reply))
    assert sp.call_ids() == ["c2", "c3", "c4"]
    assert [c.call_id for c, _ in Calls.spared(finish(calls, "c1", ("w1", 30, "", 3)))] == ["c5"]  # all left


def test_the_oldest_spare_is_taken_first_and_counted(fake: Any) -> None:
    calls = Calls(fake)
    sp = Spares(calls, "w1", lambda ids: None)
    got = leased_spares(fake, calls, "w1", 2)
    for spare in got:
        sp.received(CKEY, 1, [spare])
    first, _ = sp.take(CKEY, 8)
    second, _ = sp.take(CKEY, 8)
    assert first is not None and second is not None
    assert [first.claimed.call_id, second.claimed.call_id] == [got[0][0].call_id, got[1][0].call_id]
    assert sp.take(CKEY, 8)[0] is None
    assert sp.used == 2


@pytest.fixture
def expiring(fake: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[float], tuple[Calls, Spares]]]:
    """``expiring(ttl)``: worker w1's spares on ``fake`` with their expiry thread running (``SPARE_TTL`` =
    ttl), stopped after the test."""
    started: list[tuple[Spares, threading.Event]] = []

    def make(ttl: float) -> tuple[Calls, Spares]:
        monkeypatch.setattr(spares_mod, "SPARE_TTL", ttl)
        calls = Calls(fake)
        sp = Spares(calls, "w1", lambda ids: None)
        stopping = threading.Event()
        sp.start(stopping)
        started.append((sp, stopping))
        return calls, sp

    yield make
    for sp, stopping in started:
        stopping.set()
        sp.close()


def test_a_later_spare_goes_back_after_its_own_wait_without_waking_the_expiry_thread(fake: Any, expiring: Any) -> None:
    calls, sp = expiring(0.3)
    for i in range(4):
        submit(calls, f"c{i}", limit=1, queue_size=50)
    calls.claim(["tools"], 10, "w1", 30)
    first, later = Calls.spared(finish(calls, "c0", ("w1", 30, "", 2)))  # c1 runs; c2, c3 spares
    sp.received(CKEY, 1, [first])
    time.sleep(0.15)
    sp._wake.clear()
    sp.received(CKEY, 1, [later])  # younger than the one the thread waits for: no wake-up needed
    received = time.monotonic()
    assert not sp._wake.is_set()
    # The first goes back at its time (its old place in line), the later one only after its own wait.
    wait_for(lambda: fake.zscore(keys.waiting(CKEY), first[0].call_id) == float(first[1]))
    wait_for(lambda: fake.zscore(keys.waiting(CKEY), later[0].call_id) == float(later[1]))
    assert time.monotonic() - received >= 0.29
    assert sp.call_ids() == []


def test_a_spare_left_unused_goes_back_in_line_and_the_key_pauses(fake: Any, expiring: Any) -> None:
    calls, sp = expiring(0.05)
    (spare,) = leased_spares(fake, calls, "w1", 1)
    sp.received(CKEY, 1, [spare])
    cid = spare[0].call_id
    assert sp.call_ids() == [cid]
    wait_for(lambda: fake.zscore(keys.waiting(CKEY), cid) is not None)
    assert fake.zscore(keys.waiting(CKEY), cid) == float(spare[1])  # its old place
    assert fake.zscore(keys.LEASES, cid) is None
    assert sp.call_ids() == []
    assert sp.take(CKEY, 100) == (None, 0)  # paused: its calls end too seldom here


def test_closing_gives_every_spare_back_and_asks_for_no_more(fake: Any) -> None:
    calls = Calls(fake)
    sp = Spares(calls, "w1", lambda ids: None)
    for spare in leased_spares(fake, calls, "w1", 2):
        sp.received(CKEY, 1, [spare])
    assert sp.close() == 2
    assert fake.zcard(keys.LEASES) == 1  # the call running on the slot, not the spares
    assert not [m for m in fake.zrange(keys.waiting(CKEY), 0, -1) if fake.hget(keys.job(m.decode()), "h_spare")]
    assert sp.take(CKEY, 100) == (None, 0)


def test_a_spare_cancelled_before_it_went_back_is_ended_by_the_worker(fake: Any) -> None:
    sp, cid, ended = cancelled_spare(fake)
    sp.give_back()
    wait_for(lambda: ended == [[cid]])  # (ended on a thread of its own)


def test_an_ending_call_goes_on_with_the_workers_spare_on_its_own_thread(fake: Any, worker: Any) -> None:
    w = worker(16)
    calls = w.core.calls
    (spare,) = leased_spares(fake, calls, "w-a", 1)
    w.spares.received(CKEY, 1, [spare])
    w._local.in_call, w._local.keep = True, False
    w.core._held[CKEY] = SPARE_MIN_HELD
    handoff = w.reserve(CKEY, "tools")
    assert handoff is not None and handoff[:3] == ("w-a", w.lease, spare[0].call_id)
    assert w._local.next is spare[0] and w._local.keep is True
    # The ending write's reply: the slot went to the spare; the thread (not the pool) runs it.
    assert w._slots.take(1) == 1  # the token of the ending thread
    w.received([5, b"formatting"], CKEY, handoff)
    assert w._slots.free == 15  # not given back: the thread goes on with the spare
    assert w.pool._threads == []  # and nothing else was started


def test_a_handed_spare_leaves_the_spares_unless_a_thread_here_already_started_it(fake: Any) -> None:
    calls = Calls(fake)
    sp = Spares(calls, "w1", lambda ids: None)
    first, second = leased_spares(fake, calls, "w1", 2)
    sp.received(CKEY, 1, [first])
    sp.received(CKEY, 1, [second])
    taken, _ = sp.take(CKEY, 8)  # a thread went on with the first; its slot move is not answered yet
    assert taken is not None and taken.claimed.call_id == first[0].call_id
    assert sp.claim_handed(first[0].call_id) is False  # handed meanwhile: already running here
    assert sp.claim_handed(second[0].call_id) is True  # ours to start: out of the spares
    assert sp.call_ids() == []
    assert sp.claim_handed("some-other-call") is True
    sp.received(CKEY, 0, [], taken=first[0].call_id)  # the move answered
    assert sp.claim_handed(first[0].call_id) is True


def test_a_handed_call_already_running_here_frees_the_thread_that_waited_for_it(fake: Any, worker: Any) -> None:
    w = worker(16)
    spare = held_spare(fake, w)
    assert w.spares.take(CKEY, 8)[0] is not None  # another thread went on with it
    w._slots.take(1)  # the token the ending thread kept for the call handed to it
    reply = [5, b"formatting", spare[0].call_id.encode(), spare[0].data, b"1"]
    w.received(reply, CKEY, ("w-a", w.lease, "", 0))
    assert w._slots.free == 16  # given back: nothing new started
    assert w.pool._threads == [] and w.spares.call_ids() == []


def test_spares_leased_after_the_worker_stopped_taking_them_go_back_at_once(fake: Any) -> None:
    calls = Calls(fake)
    sp = Spares(calls, "w1", lambda ids: None)
    stopping = threading.Event()
    sp.start(stopping)
    got = leased_spares(fake, calls, "w1", 1)
    stopping.set()
    sp.wake()
    assert sp._thread is not None
    sp._thread.join(2)
    sp.received(CKEY, 1, got)  # the reply of a write sent before the stop
    assert sp.call_ids() == []
    assert fake.zscore(keys.waiting(CKEY), got[0][0].call_id) == float(got[0][1])


def test_an_error_out_of_a_call_run_neither_loses_the_thread_token_nor_the_spare(
    fake: Any, worker: Any
) -> None:
    w = worker(4)
    spare = held_spare(fake, w)
    w.core._held[CKEY] = SPARE_MIN_HELD
    ran: list[str] = []

    def run(claimed: Any) -> None:
        ran.append(claimed.call_id)
        if claimed.call_id == "first":
            assert w.reserve(CKEY, "tools") is not None  # it goes on with the spare ...
            raise RuntimeError("boom after reserve")  # ... whatever happens after

    w.runner.run = run  # type: ignore[method-assign]
    assert w._slots.take(1) == 1
    w._run_one(Claimed("first", b"", 1))
    assert ran == ["first", spare[0].call_id]
    assert w._slots.free == 4


def test_a_worker_over_its_floor_share_takes_no_spare_and_gives_its_spares_back(
    fake: Any, worker: Any
) -> None:
    w = worker(16)
    spare = held_spare(fake, w)
    # Limit 9 over two live workers: ceil share 5, floor share 4. Holding 5, it may hand its slot on
    # through Redis but not to a spare: two workers at 5 would run 10 under a limit of 9.
    now = time.time()
    fake.hset(keys.LIMITS, CKEY, 9)
    for name in ("w-a", "w-b"):
        fake.zadd(keys.queue_workers("tools"), {name: now})
    w.refresh_shares()
    w._local.in_call, w._local.keep = True, False
    w.core._held[CKEY] = 5
    handoff = w.reserve(CKEY, "tools")
    assert handoff is not None and handoff[2:] == ("", 0)
    assert w.core.outbox.flush(5)  # (given back through the outbox, after the writes before it)
    assert w.spares.call_ids() == []  # given back, at its old place in line: the raised limit's
    # free slots went to it first, then to the call behind it
    assert [m.decode() for m in fake.lrange(keys.queue("tools"), 0, -1)] == [spare[0].call_id, "c3"]


def test_a_stopping_worker_puts_a_spare_its_thread_was_to_go_on_with_back_on_the_queue(
    fake: Any, worker: Any
) -> None:
    w = worker(4)
    calls = w.core.calls
    (spare,) = leased_spares(fake, calls, "w-a", 1)
    cid = spare[0].call_id
    # c1 (handed the slot) ends; its write moves the slot to the spare its thread goes on with.
    assert int(finish(calls, "c1", ("w-a", 30, cid, 0))[0]) > 0
    assert fake.zscore(keys.slots(CKEY), cid) is not None

    def run(claimed: Any) -> None:
        w._local.keep, w._local.next = True, spare[0]
        w.request_stop()

    w.runner.run = run  # type: ignore[method-assign]
    assert w._slots.take(1) == 1
    w._run_one(Claimed("c1", b"", 1))
    assert w.core.outbox.flush(5)
    assert [m.decode() for m in fake.lrange(keys.queue("tools"), 0, -1)] == [cid]
    assert fake.zscore(keys.slots(CKEY), cid) == float("inf") and fake.zscore(keys.LEASES, cid) is None
    assert w._slots.free == 4


def test_spares_shed_by_the_worker_go_back_without_pausing_the_key(fake: Any) -> None:
    calls = Calls(fake)
    sp = Spares(calls, "w1", lambda ids: None)
    (spare,) = leased_spares(fake, calls, "w1", 1)
    sp.received(CKEY, 1, [spare])
    assert sp.give_back(CKEY, outbox=None) == 1
    assert fake.zscore(keys.waiting(CKEY), spare[0].call_id) == float(spare[1])
    assert sp.take(CKEY, 3 * SPARE_MIN_HELD)[1] > 0  # it may ask for spares again at once


def test_a_cancelled_spare_ends_at_once_instead_of_waiting_for_a_slot(fake: Any) -> None:
    sp, cid, ended = cancelled_spare(fake)
    assert sp.cancel("not-a-spare-of-ours") is False
    assert sp.cancel(cid) is True
    assert sp.call_ids() == []
    wait_for(lambda: ended == [[cid]])


def _executing(calls: Calls, cid: str) -> Running:
    info = CallInfo.of(env(cid), CKEY)
    current = State.PENDING
    for step in (State.ROUTING, State.EXECUTING):
        assert calls.transition(info, step, attempt=1, current=current)[0] > 0
        current = step
    return Running(info, env(cid), 1, state=State.EXECUTING)


def test_spares_shed_as_a_call_ends_keep_their_place_even_when_its_end_would_join_an_earlier_write(
    fake: Any, worker: Any
) -> None:
    w = worker(8)
    w.core.calls.load_scripts()
    held_spare(fake, w)  # c1 on the slot (limit 1), c2 our spare, c3 waits
    run = _executing(w.core.calls, "c1")
    now = time.time()
    for name in ("w-a", "w-b"):  # limit 1 over two workers: holding 2, it is over its share
        fake.zadd(keys.queue_workers("tools"), {name: now})
    w.refresh_shares()
    w.core._held[CKEY] = 2
    w._local.in_call, w._local.keep = True, False
    gate = threading.Event()  # hold the sender: the formatting write is still open as the call ends
    w.core.outbox.put(lambda pipe: gate.wait(5))
    time.sleep(0.05)
    w.runner._move(run, State.FORMATTING)
    w.runner._finish(run, State.DONE, result={"ok": 1})  # sheds c2, then its end frees the slot
    gate.set()
    assert w.core.outbox.flush(5)
    assert [m.decode() for m in fake.lrange(keys.queue("tools"), 0, -1)] == ["c2"]  # not the younger c3


def test_spares_shed_as_a_call_goes_retrying_keep_their_place(
    fake: Any, worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = worker(8)
    w.core.calls.load_scripts()
    held_spare(fake, w)
    run = _executing(w.core.calls, "c1")
    monkeypatch.setattr(retry_mod, "plan", lambda core, run, error: (5.0, retry_mod.RetryPolicy(max=3)))
    assert w.runner._retry(run, HermesError("boom"))
    assert w.core.outbox.flush(5)
    assert [m.decode() for m in fake.lrange(keys.queue("tools"), 0, -1)] == ["c2"]


def test_a_spare_one_thread_went_on_with_that_another_ending_write_took_first_keeps_its_slot(
    fake: Any, worker: Any
) -> None:
    w = worker(8)
    started: list[tuple[str, Any]] = []
    w._start = lambda claimed, run: started.append((claimed.call_id, run))  # type: ignore[method-assign]
    calls = w.core.calls
    for i in range(6):
        submit(calls, f"c{i}", limit=2, queue_size=50)
    calls.claim(["tools"], 10, "w-a", 30)  # c0, c1 run
    reply = finish(calls, "c0", ("w-a", 30, "", 1))  # c2 handed the slot, c3 our spare
    w.spares.received(CKEY, 1, Calls.spared(reply))
    spare, _ = w.spares.take(CKEY, 8)  # thread T1 (ending c2, later) goes on with c3 ...
    assert spare is not None and spare.claimed.call_id == "c3"
    # ... but c1's ending write, with no spare named, reaches Redis first: its slot goes to our oldest
    # spare, c3, already running here. That thread's token goes back.
    assert w._slots.take(1) == 1
    t2 = finish(calls, "c1", ("w-a", 30, "", 0))
    w.received(t2, CKEY, ("w-a", w.lease, "", 0))
    assert started == [] and w._slots.free == 8
    # T1's write then finds c3 moved already: c2's slot goes to c4, started with a token of its own.
    t1 = finish(calls, "c2", ("w-a", 30, "c3", 0))
    w.received(t1, CKEY, ("w-a", w.lease, "c3", 0))
    assert "c3" not in w._slotless
    assert started == [("c4", w._run_one)] and w._slots.free == 7
    assert [m.decode() for m in fake.zrange(keys.slots(CKEY), 0, -1)] == ["c3", "c4"]
