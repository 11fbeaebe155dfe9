"""Fair dispatch on a real Redis: which waiting call of a concurrency key gets the next free slot.

Promotion order is read from the queue list (promote RPUSHes each call it gives a slot), with slots freed
one at a time by ending a call that holds one: no timing involved.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from typing import Any

import pytest
import redis

from broker import keys
from broker.calls import CallInfo, Calls
from broker.envelope import Envelope, Options
from broker.errors import QueueFull
from broker.states import State

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CKEY = "tool:t"
TAG = "{tools}"


def env(cid: str, who: str, klass: str | None = None) -> Envelope:
    return Envelope(
        call_id=f"{TAG}.{cid}",
        kind="tool",
        tool="t",
        args={},
        traceparent=TP,
        context={"principal": who},
        options=Options(call_class=klass),
        queue="tools",
        channel="hermes:ch:test",
    )


def submit(
    calls: Calls,
    cid: str,
    who: str,
    klass: str | None = None,
    *,
    limit: int = 2,
    queue_size: int = 100_000,
    weight: float = 1.0,
    share: float = 0.1,
    key_size: int = -1,
    pipeline: Any = None,
) -> Any:
    reply = calls.submit(
        env(cid, who, klass),
        ckey=CKEY,
        queue_size=queue_size,
        max_attempts=3,
        timeout=5,
        concurrency=limit,
        weight=weight,
        batch_share=share,
        key_size=key_size,
        pipeline=pipeline,
    )
    return reply if pipeline is not None else Calls.check_submit(reply, CKEY, queue_size)


def promoted(r: redis.Redis) -> list[str]:
    """Every call given a slot so far, in order (ids without their tag)."""
    return [c.decode().split(".", 1)[1] for c in r.lrange(keys.queue("tools"), 0, -1)]


def release(calls: Calls, cid: str, who: str, klass: str | None = None) -> None:
    """End a call holding a slot (cancelled before any worker took it): its slot goes to the next in turn."""
    info = CallInfo.of(env(cid, who, klass), CKEY)
    assert calls.cancel_unleased(info, attempt=1, error={"type": "cancelled"})[0] > 0


def drain(calls: Calls, r: redis.Redis, owners: dict[str, tuple[str, str | None]], n: int) -> list[str]:
    """Free ``n`` slots one by one, each of the oldest call holding one; the calls promoted meanwhile."""
    before = len(promoted(r))
    done = 0
    while done < n:
        held = [m.decode().split(".", 1)[1] for m in r.zrange(keys.slots(TAG, CKEY), 0, 0)]
        if not held:
            break
        release(calls, held[0], *owners[held[0]])
        done += 1
    return promoted(r)[before:]


def fair_state(r: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(keys.fair(TAG, CKEY)).items()}


def test_an_interactive_call_is_served_within_one_round_behind_a_batch(conn: redis.Redis) -> None:
    calls, limit = Calls(conn), 4
    owners: dict[str, tuple[str, str | None]] = {}
    pipe = conn.pipeline(transaction=False)
    for i in range(500):  # a batch of 500 (the first `limit` take the slots at once)
        owners[f"b{i}"] = ("batcher", "batch")
        submit(calls, f"b{i}", "batcher", "batch", limit=limit, pipeline=pipe)
    # Another principal's interactive backlog too: the agent's call must also get past it.
    for i in range(200):
        owners[f"o{i}"] = ("other", None)
        submit(calls, f"o{i}", "other", limit=limit, pipeline=pipe)
    pipe.execute()
    owners["agent"] = ("agent", None)
    submit(calls, "agent", "agent", limit=limit)
    assert "agent" not in promoted(conn)
    order = drain(calls, conn, owners, limit + 1)
    assert "agent" in order, order  # within the next round of slots, not after 699 calls
    # While interactive calls wait, batch still gets its share: not starved, not first.
    order += drain(calls, conn, owners, 100)
    batch = sum(1 for c in order if c.startswith("b"))
    assert 5 <= batch <= 15, order


def test_keys_of_one_class_take_turns_by_weight_fifo_within_a_key(conn: redis.Redis) -> None:
    calls = Calls(conn)
    owners: dict[str, tuple[str, str | None]] = {"r0": ("x", None), "r1": ("x", None)}
    submit(calls, "r0", "x")
    submit(calls, "r1", "x")  # the two slots are held from here on
    pipe = conn.pipeline(transaction=False)
    for i in range(300):
        owners[f"h{i}"] = ("heavy", None)
        submit(calls, f"h{i}", "heavy", weight=2, pipeline=pipe)
    for i in range(300):
        owners[f"l{i}"] = ("light", None)
        submit(calls, f"l{i}", "light", pipeline=pipe)
    pipe.execute()
    order = drain(calls, conn, owners, 300)
    counts = Counter(c[0] for c in order)
    assert abs(counts["h"] - 200) <= 1 and counts["h"] + counts["l"] == 300, counts  # 2:1 (within one) while both wait
    heavy = [int(c[1:]) for c in order if c[0] == "h"]
    light = [int(c[1:]) for c in order if c[0] == "l"]
    assert heavy == sorted(heavy) and light == sorted(light)  # each key in its own submission order


def test_batch_gets_its_share_under_a_large_interactive_backlog_and_all_of_an_idle_fleet(conn: redis.Redis) -> None:
    calls = Calls(conn)
    owners: dict[str, tuple[str, str | None]] = {"r0": ("x", None), "r1": ("x", None)}
    submit(calls, "r0", "x")
    submit(calls, "r1", "x")
    pipe = conn.pipeline(transaction=False)
    for i in range(300):
        owners[f"i{i}"] = (f"agent{i % 50}", None)
        submit(calls, f"i{i}", f"agent{i % 50}", pipeline=pipe)
    for i in range(300):
        owners[f"b{i}"] = ("batch-1", "batch")
        submit(calls, f"b{i}", "batch-1", "batch", share=0.25, pipeline=pipe)
    pipe.execute()
    order = drain(calls, conn, owners, 400)
    assert Counter(c[0] for c in order) == {"i": 300, "b": 100}  # 0.25 of the promotions: 1 in 4, exactly
    # Once no interactive call waits, batch takes every slot (work-conserving).
    order = drain(calls, conn, owners, 1000)
    assert order == [f"b{i}" for i in range(100, 300)]
    assert conn.exists(keys.fair(TAG, CKEY)) == 0  # nobody waits: no fair state left


def test_queue_size_per_key_refuses_only_that_key_and_counts_both_classes_in_queue_size(conn: redis.Redis) -> None:
    calls = Calls(conn)
    submit(calls, "r0", "x", limit=1)
    for i in range(3):
        submit(calls, f"a{i}", "alice", limit=1, key_size=3)
    with pytest.raises(QueueFull) as err:
        submit(calls, "a3", "alice", limit=1, key_size=3)
    assert err.value.details == {"key": CKEY, "fairness_key": "alice", "limit": 3, "depth": 3}
    assert "alice" in str(err.value) and conn.exists(keys.job(f"{TAG}.a3")) == 0
    submit(calls, "b0", "bob", limit=1, key_size=3)  # another key still gets in
    submit(calls, "c0", "alice", "batch", limit=1, key_size=3)  # (per class: alice's batch calls apart)
    # queue_size bounds both classes together: 5 wait now.
    with pytest.raises(QueueFull) as full:
        submit(calls, "d0", "dave", "batch", limit=1, queue_size=5)
    assert full.value.details["depth"] == 5 and "fairness_key" not in full.value.details


def test_a_batch_filling_queue_size_leaves_room_for_interactive_calls(conn: redis.Redis) -> None:
    calls = Calls(conn)
    submit(calls, "z0", "zed", "batch", limit=1, queue_size=3)  # (takes the slot)
    for i in range(1, 4):
        submit(calls, f"z{i}", "zed", "batch", limit=1, queue_size=3)
    with pytest.raises(QueueFull):  # the batch's fourth waits for room (its submitter sends it again)
        submit(calls, "z4", "zed", "batch", limit=1, queue_size=3)
    for i in range(3):  # an agent's calls are not refused for the batch's backlog, only for their own
        submit(calls, f"a{i}", "alice", limit=1, queue_size=3)
    with pytest.raises(QueueFull) as full:
        submit(calls, "a3", "alice", limit=1, queue_size=3)
    assert full.value.details["depth"] == 3
    with pytest.raises(QueueFull) as full:  # batch calls count both classes
        submit(calls, "z4", "zed", "batch", limit=1, queue_size=3)
    assert full.value.details["depth"] == 6


def test_cancelling_waiting_calls_keeps_the_counts_and_the_fair_hash_empties(conn: redis.Redis) -> None:
    calls = Calls(conn)
    owners: dict[str, tuple[str, str | None]] = {"r0": ("x", None)}
    submit(calls, "r0", "x", limit=1)
    for i in range(4):
        owners[f"a{i}"] = ("alice", None)
        submit(calls, f"a{i}", "alice", limit=1, key_size=4)
    owners["z0"] = ("zed", "batch")
    submit(calls, "z0", "zed", "batch", limit=1)
    assert fair_state(conn)["n:i:alice"] == "4" and fair_state(conn)["n:b:zed"] == "1"
    release(calls, "a1", "alice")  # cancelled while waiting
    release(calls, "z0", "zed", "batch")
    state = fair_state(conn)
    assert state["n:i:alice"] == "3" and "n:b:zed" not in state and "l:b:zed" not in state
    assert promoted(conn) == ["r0"]  # a waiting call's end frees no slot
    submit(calls, "a4", "alice", limit=1, key_size=4)  # room again for alice's fourth
    assert drain(calls, conn, owners | {"a4": ("alice", None)}, 10) == ["a0", "a2", "a3", "a4"]
    assert conn.exists(keys.fair(TAG, CKEY), keys.waiting(TAG, CKEY), keys.waiting_batch(TAG, CKEY)) == 0


def test_a_call_handed_back_goes_before_every_waiting_call_a_retry_takes_its_keys_turn(conn: redis.Redis) -> None:
    calls = Calls(conn)
    owners: dict[str, tuple[str, str | None]] = {}
    for i in range(3):
        owners[f"a{i}"] = ("alice", None)
        submit(calls, f"a{i}", "alice", limit=1)
    owners["z0"] = ("zed", None)
    submit(calls, "z0", "zed", limit=1)
    calls.claim(["tools"], 1, "w", 30)
    info = CallInfo.of(env("a0", "alice"), CKEY)
    calls.transition(info, State.ROUTING, attempt=1)
    assert calls.hand_back(info, attempt=1, current=State.ROUTING, reason="worker stopping")
    # a0's slot went to the next in turn (a1; zed's z0 came in the next round, with a2), a0 waits first.
    assert fair_state(conn)["n:i:alice"] == "2" and promoted(conn) == ["a1"]
    assert [m.decode() for m in conn.zrange(keys.waiting(TAG, CKEY), 0, -1)] == [f"{TAG}.{c}" for c in ("a0", "a2", "z0")]
    # A retry of a1 frees its slot for a0 and comes back at alice's next turn: after a2, and after z0.
    calls.claim(["tools"], 1, "w", 30)
    a1 = CallInfo.of(env("a1", "alice"), CKEY)
    calls.transition(a1, State.ROUTING, attempt=1)
    calls.retry(a1, attempt=1, current=State.ROUTING, detail={})
    calls.requeue(a1, attempt=2)
    assert promoted(conn) == ["a0"]
    conn.delete(keys.queue("tools"))
    assert drain(calls, conn, owners, 5) == ["a2", "z0", "a1"]
    assert conn.exists(keys.fair(TAG, CKEY)) == 0


def _race(url: str, proc: int, per: int, barrier: Any, out: Any) -> None:
    calls = Calls(redis.Redis.from_url(url))
    pipe = calls.conn.pipeline(transaction=False)
    klass = "batch" if proc == 0 else None
    for i in range(per):
        who = "hog" if i % 2 else f"p{proc}"
        submit(calls, f"p{proc}-{i}", who, klass, limit=5, queue_size=60, key_size=10, pipeline=pipe)
    barrier.wait()
    c = "b" if klass else "i"
    out.put([(int(r[0]), f"n:{c}:{r[3].decode()}" if int(r[0]) == -3 else "") for r in pipe.execute()])


def test_limit_queue_size_and_per_key_size_are_exact_when_processes_race(redis_url: str, conn: redis.Redis) -> None:
    ctx = multiprocessing.get_context("fork")
    procs, per = 6, 40  # 240 calls: half of them one key's ("hog"), in both classes
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_race, args=(redis_url, p, per, barrier, out)) for p in range(procs)]
    for w in workers:
        w.start()
    replies = [r for _ in workers for r in out.get(timeout=30)]
    for w in workers:
        w.join(10)
    codes = Counter(code for code, _ in replies)
    interactive = conn.zcard(keys.waiting(TAG, CKEY))
    waiting = interactive + conn.zcard(keys.waiting_batch(TAG, CKEY))
    # 5 slots + 60 interactive calls waiting (the per-key bounds leave room for 60 of them and 20 batch calls,
    # which count the interactive ones too): never one more.
    assert conn.zcard(keys.slots(TAG, CKEY)) == 5 and interactive == 60 and 60 <= waiting <= 80
    assert codes[1] == 5 + waiting
    assert codes[1] + codes[-1] + codes[-3] == procs * per and codes[-3] > 0
    # Each key's count is exact (they add up to what waits), none past 10, and a key refused is at 10.
    counts = {f: int(v) for f, v in fair_state(conn).items() if f.startswith("n:")}
    assert sum(counts.values()) == waiting and max(counts.values()) == 10
    assert all(counts[k] == 10 for _, k in replies if k)
