"""Concurrency slots and queue sizes: admission, FIFO promotion, release on every ending, sweep, races."""

from __future__ import annotations

import multiprocessing
import random
import time
from typing import Any

import pytest
import redis

from broker import keys
from broker.calls import CallInfo, Calls
from broker.envelope import Envelope
from broker.errors import QueueFull
from broker.limits import Limits
from broker.states import State

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CKEY = "tool:t"


def env(call_id: str) -> Envelope:
    return Envelope(
        call_id=call_id,
        kind="tool",
        tool="t",
        args={},
        traceparent=TP,
        queue="tools",
        channel="hermes:ch:test",
    )


def submit(calls: Calls, cid: str, limit: int = 2, queue_size: int = 10) -> tuple[bool, str]:
    reply = calls.submit(
        env(cid), ckey=CKEY, queue_size=queue_size, max_attempts=3, timeout=5, concurrency=limit
    )
    return Calls.check_submit(reply, CKEY, queue_size)


def end(calls: Calls, cid: str, state: State = State.DONE) -> None:
    info = CallInfo.of(env(cid), CKEY)
    path = [State.ROUTING, State.EXECUTING, State.FORMATTING] if state is State.DONE else [State.ROUTING]
    current = State.PENDING
    for step in [*path, state]:
        assert calls.transition(info, step, attempt=1, current=current)[0] > 0
        current = step


def queued(r: Any) -> list[str]:
    return [c.decode() for c in r.lrange(keys.queue("tools"), 0, -1)]


def test_only_calls_holding_a_slot_are_queued_and_a_freed_slot_goes_to_the_oldest(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(5):
        submit(calls, f"c{i}")
    assert queued(fake) == ["c0", "c1"]
    assert [m.decode() for m in fake.zrange(keys.waiting("{tools}", CKEY), 0, -1)] == ["c2", "c3", "c4"]
    assert [c.call_id for c in calls.claim(["tools"], 10, "w", 30)] == ["c0", "c1"]
    end(calls, "c1")
    assert queued(fake) == ["c2"]  # the oldest waiting call, at once
    end(calls, "c0", State.FAILED)
    assert queued(fake) == ["c2", "c3"]
    assert fake.zcard(keys.slots("{tools}", CKEY)) == 2


def test_every_ending_and_a_retry_give_the_slot_back_a_cancelled_waiter_leaves_the_queue(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(4):
        submit(calls, f"c{i}", limit=1)
    # Cancelling a waiting call takes it out of the waiting set; nothing is promoted for it.
    info3 = CallInfo.of(env("c3"), CKEY)
    assert calls.transition(info3, State.CANCELLED, attempt=1, fence=False)[0] > 0
    assert fake.zscore(keys.waiting("{tools}", CKEY), "c3") is None and queued(fake) == ["c0"]
    # A retry releases the slot (the next call gets it) and comes back through admission, waiting.
    calls.claim(["tools"], 1, "w", 30)
    info0 = CallInfo.of(env("c0"), CKEY)
    calls.transition(info0, State.ROUTING, attempt=1)
    calls.transition(info0, State.RETRYING, attempt=1, current=State.ROUTING, schedule_at=time.time() - 1)
    assert queued(fake) == ["c1"] and fake.zscore(keys.scheduled("{tools}"), "c0") is not None
    calls.transition(info0, State.PENDING, attempt=1, requeue=True, requeue_first=True, current=State.RETRYING)
    assert fake.zscore(keys.scheduled("{tools}"), "c0") is None
    assert [m.decode() for m in fake.zrange(keys.waiting("{tools}", CKEY), 0, -1)] == ["c0", "c2"]  # first: before c2
    calls.claim(["tools"], 1, "w", 30)
    end(calls, "c1")
    assert queued(fake) == ["c0"]


def test_queue_size_counts_only_the_calls_waiting_beyond_the_limit(fake: Any) -> None:
    calls = Calls(fake)
    assert submit(calls, "a", limit=2, queue_size=0)[0] and submit(calls, "b", limit=2, queue_size=0)[0]
    with pytest.raises(QueueFull) as info:
        submit(calls, "c", limit=2, queue_size=0)
    assert info.value.details == {"key": CKEY, "limit": 0, "depth": 0}


def test_a_raised_limit_fills_the_new_slots_at_the_next_submission(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(4):
        submit(calls, f"c{i}", limit=1)
    assert queued(fake) == ["c0"]
    submit(calls, "c4", limit=3)
    assert queued(fake) == ["c0", "c1", "c2"]


def test_due_retries_are_held_for_the_caller_and_a_call_no_longer_retrying_leaves_the_schedule(fake: Any) -> None:
    calls, limits = Calls(fake), Limits(fake)
    now = time.time()
    for cid, at in (("c0", now - 2), ("c1", now - 1), ("c2", now + 60)):
        submit(calls, cid, limit=5)
        info = CallInfo.of(env(cid), CKEY)
        calls.transition(info, State.ROUTING, attempt=1)
        calls.transition(info, State.RETRYING, attempt=1, current=State.ROUTING, schedule_at=at)
    # c1 was cancelled while it waited for its next attempt: it is no retry any more.
    calls.transition(CallInfo.of(env("c1"), CKEY), State.CANCELLED, attempt=1, current=State.RETRYING)
    due, nxt = limits.due(["tools"], hold=30)
    assert [d.call_id for d in due] == ["c0"]
    assert fake.zscore(keys.scheduled("{tools}"), "c1") is None  # dropped, not held and returned again later
    assert fake.zscore(keys.scheduled("{tools}"), "c0") >= now + 29  # held for this caller
    assert nxt is not None and abs(nxt - (now + 30)) < 5  # c0's hold comes first, then c2 (60 s)
    assert limits.due(["tools"], hold=30)[0] == []  # held: no other scheduler takes it meanwhile


def test_the_sweep_frees_slots_of_calls_that_ended_and_refills(fake: Any) -> None:
    calls, limits = Calls(fake), Limits(fake)
    for i in range(3):
        submit(calls, f"c{i}", limit=2)
    calls.claim(["tools"], 2, "w", 30)
    # A slot left behind by a call that is gone (a crash between writes of an older version, a flush).
    fake.delete(keys.job("c0"))
    fake.zadd(keys.slots("{tools}", CKEY), {"c0": time.time() - 100})
    fake.zadd(keys.slots("{tools}", CKEY), {"c1": time.time() - 100})  # c1 still runs (pending): left alone
    assert limits.sweep(["tools"], grace=10) == 1
    assert queued(fake) == ["c2"]
    assert limits.snapshot() == [{"key": CKEY, "limit": 2, "running": 2, "waiting": 0}]


def test_random_operations_never_hold_more_slots_than_the_limit(fake: Any) -> None:
    calls, rng = Calls(fake), random.Random(7)
    live: list[str] = []
    for i in range(300):
        op = rng.random()
        if op < 0.5:
            try:
                submit(calls, f"c{i}", limit=3, queue_size=5)
            except QueueFull:
                pass
        elif op < 0.8:
            for c in calls.claim(["tools"], rng.randint(1, 3), "w", 30):
                live.append(c.call_id)
        elif live:
            end(
                calls,
                live.pop(rng.randrange(len(live))),
                rng.choice([State.DONE, State.FAILED, State.CANCELLED]),
            )
        assert fake.zcard(keys.slots("{tools}", CKEY)) <= 3
        assert fake.zcard(keys.waiting("{tools}", CKEY)) <= 5
        assert fake.zcard(keys.waiting("{tools}", CKEY)) == 0 or fake.zcard(keys.slots("{tools}", CKEY)) == 3


def _race(url: str, proc: int, per: int, barrier: Any, out: Any) -> None:
    calls = Calls(redis.Redis.from_url(url))
    pipe = calls.conn.pipeline(transaction=False)
    for i in range(per):
        calls.submit(
            env(f"p{proc}-{i}"),
            ckey=CKEY,
            queue_size=50,
            max_attempts=3,
            timeout=5,
            concurrency=5,
            pipeline=pipe,
        )
    barrier.wait()
    out.put([int(r[0]) for r in pipe.execute()])


def test_queue_full_is_exact_when_processes_race(redis_url: str, conn: redis.Redis) -> None:
    ctx = multiprocessing.get_context("fork")
    procs, per = 4, 40
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_race, args=(redis_url, p, per, barrier, out)) for p in range(procs)]
    for w in workers:
        w.start()
    codes = [c for _ in workers for c in out.get(timeout=30)]
    for w in workers:
        w.join(10)
    # 5 slots + 50 waiting, never one more, whatever the interleaving.
    assert codes.count(1) == 55 and codes.count(-1) == procs * per - 55
    assert conn.zcard(keys.slots("{tools}", CKEY)) == 5 and conn.zcard(keys.waiting("{tools}", CKEY)) == 50
    assert conn.llen(keys.queue("tools")) == 5
