"""Call records: submission (duplicates, idempotency, admission), claiming and lease expiry."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import Job

from broker import events, keys
from broker.calls import CallInfo, Calls
from broker.codec import MsgpackSerializer, unpack
from broker.envelope import Envelope, Options
from broker.errors import QueueFull
from broker.states import State

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CKEY = "tool:echo"


def env(
    call_id: str, *, tool: str = "echo", queue: str = "tools", idem: str | None = None, **args: Any
) -> Envelope:
    return Envelope(
        call_id=call_id,
        kind="tool",
        tool=tool,
        args=args,
        traceparent=TP,
        queue=queue,
        channel="hermes:ch:test",
        options=Options(idempotency_key=idem),
    )


def submit(
    calls: Calls, e: Envelope, queue_size: int = -1, ckey: str = CKEY, concurrency: int = -1
) -> tuple[bool, str]:
    reply = calls.submit(e, ckey=ckey, queue_size=queue_size, max_attempts=3, timeout=5, concurrency=concurrency)
    return Calls.check_submit(reply, ckey, queue_size)


def test_a_submitted_call_is_an_rq_job_on_an_rq_queue(fake: Any) -> None:
    calls = Calls(fake)
    assert submit(calls, env("c1", city="北京")) == (True, "c1")
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"c1"]
    assert fake.smembers(keys.RQ_QUEUES) == {keys.queue("tools").encode()}
    rec = calls.record("c1")
    assert rec is not None
    assert (rec["state"], rec["attempt"], rec["seq"], rec["name"], rec["queue"]) == (
        "pending",
        1,
        1,
        "echo",
        "tools",
    )
    assert rec["envelope"].call_id == "c1" and rec["envelope"].args == {"city": "北京"}
    # RQ itself reads it: status, origin, and the function + args through our msgpack serializer.
    job = Job.fetch("c1", connection=fake, serializer=MsgpackSerializer)
    assert job.get_status() == "queued"
    assert job.origin == "tools"
    assert job.func_name == "workers.entry.run_call"
    assert job.args[0]["call_id"] == "c1" and job.args[0]["args"] == {"city": "北京"}
    assert Queue(keys.tag("tools"), connection=fake, serializer=MsgpackSerializer).job_ids == ["c1"]
    assert [e.state for e in events.history(fake, "c1")] == ["pending"]


def test_submitting_the_same_call_id_twice_is_a_no_op(fake: Any) -> None:
    calls = Calls(fake)
    assert submit(calls, env("c1", n=1)) == (True, "c1")
    assert submit(calls, env("c1", n=2)) == (False, "c1")
    assert fake.llen(keys.queue("tools")) == 1
    assert fake.llen(keys.history("c1")) == 1
    assert fake.zcard(keys.slots("{tools}", CKEY)) == 1  # no limit: it holds a slot at once
    assert calls.record("c1")["envelope"].args == {"n": 1}


def test_an_idempotency_key_returns_the_call_that_already_exists(fake: Any) -> None:
    calls = Calls(fake)
    assert submit(calls, env("first", idem="order-42")) == (True, "first")
    assert submit(calls, env("second", idem="order-42")) == (False, "first")
    assert not fake.exists(keys.job("second"))
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"first"]
    assert 0 < fake.ttl(keys.idempotency("{tools}", "order-42"))
    assert submit(calls, env("third", idem="order-43")) == (True, "third")


def test_queue_full_is_refused_at_once_and_admits_again_after_a_call_ends(fake: Any) -> None:
    # queue_size bounds the calls waiting beyond the concurrency limit (here 1 running + 3 waiting).
    calls = Calls(fake)
    for i in range(4):
        assert submit(calls, env(f"c{i}"), queue_size=3, concurrency=1)[0]
    with pytest.raises(QueueFull) as info:
        submit(calls, env("c4"), queue_size=3, concurrency=1)
    assert info.value.details == {"key": CKEY, "limit": 3, "depth": 3}
    assert not fake.exists(keys.job("c4")) and not fake.exists(keys.history("c4"))
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"c0"]
    # Another concurrency key on the same queue has its own limit.
    assert submit(calls, env("other", tool="other"), queue_size=3, ckey="tool:other", concurrency=1)[0]
    assert [c.call_id for c in calls.claim(["tools"], 1, "w1", 30)] == ["c0"]
    with pytest.raises(QueueFull):  # claiming does not free a slot: ending does
        submit(calls, env("c4"), queue_size=3, concurrency=1)
    assert calls.transition(CallInfo.of(env("c0"), CKEY), State.CANCELLED, attempt=1, fence=False)[0] > 0
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"other", b"c1"]
    assert submit(calls, env("c4"), queue_size=3, concurrency=1) == (True, "c4")


def test_a_cancelled_call_frees_its_place_in_the_waiting_queue(fake: Any) -> None:
    calls = Calls(fake)
    submit(calls, env("c0"), queue_size=1)
    info = CallInfo.of(env("c0"), CKEY)
    assert calls.transition(info, State.CANCELLED, attempt=1, fence=False)[0] > 0
    fake.zrem(keys.waiting("{tools}", CKEY), "c0")  # what cancel_call does
    assert submit(calls, env("c1"), queue_size=1)[0]


def test_admission_is_atomic_under_racing_pipelines(conn: redis.Redis) -> None:
    # Eight threads each pipeline 50 submissions against 10 slots and 120 waiting: exactly 130 get in.
    limit, threads, per, running = 120, 8, 50, 10
    results: list[Any] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def client(t: int) -> None:
        calls = Calls(redis.Redis(connection_pool=conn.connection_pool))
        pipe = calls.conn.pipeline(transaction=False)
        for i in range(per):
            calls.submit(
                env(f"t{t}-{i}"),
                ckey=CKEY,
                queue_size=limit,
                max_attempts=3,
                timeout=5,
                concurrency=running,
                pipeline=pipe,
            )
        start.wait()
        replies = pipe.execute()
        with lock:
            results.extend(replies)

    pool = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    accepted = [r for r in results if int(r[0]) == 1]
    refused = [r for r in results if int(r[0]) == -1]
    assert len(accepted) == limit + running and len(refused) == threads * per - limit - running
    assert conn.zcard(keys.waiting("{tools}", CKEY)) == limit
    assert conn.llen(keys.queue("tools")) == running
    assert len(conn.keys(keys.RQ_JOB.format("*"))) == limit + running
    assert all(int(r[1]) == limit for r in refused)


def test_claim_takes_calls_in_order_and_leases_them(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(5):
        submit(calls, env(f"c{i}"))
    before = time.time()
    got = calls.claim(["tools"], 3, "worker-a", 30)
    assert [c.call_id for c in got] == ["c0", "c1", "c2"]
    assert all(c.attempt == 1 and c.data for c in got)
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"c3", b"c4"]
    assert fake.zscore(keys.slots("{tools}", CKEY), "c3") == float("inf")  # queued: holds its slot, not leased
    for c in got:
        assert before + 29 < fake.zscore(keys.leases("{tools}"), c.call_id) < time.time() + 31
        assert fake.zscore(keys.slots("{tools}", CKEY), c.call_id) == fake.zscore(keys.leases("{tools}"), c.call_id)
        assert fake.zscore(keys.leases("{tools}"), c.call_id).is_integer()  # whole seconds: listpacks keep integers
        assert fake.hget(keys.job(c.call_id), keys.F_WORKER) == b"worker-a"
        assert fake.hget(keys.job(c.call_id), "worker_name") == b"worker-a"
        assert unpack(c.data)[2][0]["call_id"] == c.call_id


@pytest.mark.parametrize("broker", ["conn", "fake"])
def test_a_claim_on_a_kept_connection_takes_and_leases_as_the_stock_path_does(broker: str, request: Any) -> None:
    """The dispatcher's claims go through ``pipes`` on a connection it keeps: the same calls, in order,
    leased the same way, also after the server lost its scripts (NOSCRIPT: loaded again, sent again; on
    fakeredis, whose scripts are this test's alone)."""
    r = request.getfixturevalue(broker)
    calls = Calls(r)
    for i in range(5):
        submit(calls, env(f"c{i}"))
    kept = r.connection_pool.get_connection()
    try:
        got = calls.claim(["tools"], 2, "worker-a", 30, kept)
        assert [c.call_id for c in got] == ["c0", "c1"] and all(c.attempt == 1 and c.data for c in got)
        assert leased(r, "c1") and r.hget(keys.job("c1"), keys.F_WORKER) == b"worker-a"
        if broker == "fake":  # (SCRIPT FLUSH is the server's: on the shared one, tests beside this one would fail)
            r.script_flush()
        assert [c.call_id for c in calls.claim(["tools"], 5, "worker-a", 30, kept)] == ["c2", "c3", "c4"]
        assert calls.claim(["tools"], 5, "worker-a", 30, kept) == [] and leased(r, "c4")
    finally:
        r.connection_pool.release(kept)


def leased(r: Any, call_id: str) -> bool:
    score = r.zscore(keys.leases("{tools}"), call_id)
    return score is not None and time.time() + 29 < score < time.time() + 31 and score == r.zscore(keys.slots("{tools}", CKEY), call_id)


@pytest.mark.parametrize("broker", ["conn", "fake"])
def test_a_worker_ending_a_call_takes_the_next_one_its_release_promoted_in_the_same_script(broker: str, request: Any) -> None:
    """TRANSITION with ``take``: the call waiting for the slot the ending call gives back is promoted and
    leased to that worker at once, with no wake-up for the other workers (nothing left on the queue); one
    more waiting call stays waiting, and an ending with nothing to take returns no calls."""
    r = request.getfixturevalue(broker)
    calls = Calls(r)
    for i in range(3):
        assert submit(calls, env(f"c{i}"), concurrency=1)[0]
    [first] = calls.claim(["tools"], 1, "w1", 30)
    wakes = r.pubsub()
    wakes.subscribe(calls.wake_channel("tools"))
    assert wakes.get_message(timeout=1)["type"] == "subscribe"
    info = CallInfo.of(env("c0"), CKEY)
    reply = calls.transition(info, State.CANCELLED, attempt=1, fence=False, ttl=60, take=[*calls.claim_args("tools", 1, "w1", 30), 0, 1])
    assert reply[0] > 0 and first.call_id == "c0"
    [taken] = calls.claimed("tools", reply[2], reply[3])
    assert (taken.call_id, taken.attempt) == ("c1", 1) and unpack(taken.data)[2][0]["call_id"] == "c1"
    assert r.hget(keys.job("c1"), keys.F_WORKER) == b"w1" and r.zscore(keys.leases("{tools}"), "c1") > time.time()
    assert r.zscore(keys.slots("{tools}", CKEY), "c1") == r.zscore(keys.leases("{tools}"), "c1")  # leased, not queued
    assert r.llen(keys.queue("tools")) == 0 and r.zcard(keys.waiting("{tools}", CKEY)) == 1  # c2 still waits
    assert wakes.get_message(timeout=0.2) is None  # nobody else was woken for it
    r.hset(keys.job("c2"), "h_state", "cancelled")  # (c2 leaves without a slot: the next ending takes none)
    r.zrem(keys.waiting("{tools}", CKEY), "c2")
    done = calls.transition(CallInfo.of(env("c1"), CKEY), State.CANCELLED, attempt=1, fence=False, ttl=60, take=[*calls.claim_args("tools", 1, "w1", 30), 0, 1])
    assert done[0] > 0 and calls.claimed("tools", done[2], done[3]) == []
    wakes.close()


@pytest.mark.parametrize("broker", ["conn", "fake"])
def test_a_worker_at_its_share_of_a_key_takes_no_next_call_and_wakes_the_others(broker: str, request: Any) -> None:
    """The share rule of TRANSITION's ``take``: a worker holding ``held`` other calls of the key with
    ``peers`` workers on the queue takes only while held * peers < the limit. At its share the call its
    release promoted goes onto the queue with a wake-up for every worker, and the reply says it took none."""
    r = request.getfixturevalue(broker)
    calls = Calls(r)
    for i in range(4):
        assert submit(calls, env(f"c{i}"), concurrency=2)[0]
    assert [c.call_id for c in calls.claim(["tools"], 2, "w1", 30)] == ["c0", "c1"]
    wakes = r.pubsub()
    wakes.subscribe(calls.wake_channel("tools"))
    assert wakes.get_message(timeout=1)["type"] == "subscribe"
    # w1 holds c1 besides the ending c0, two workers share the queue: 1 * 2 >= 2, its share is used.
    reply = calls.transition(CallInfo.of(env("c0"), CKEY), State.CANCELLED, attempt=1, fence=False, ttl=60, take=[*calls.claim_args("tools", 1, "w1", 30), 1, 2])
    assert reply[0] > 0 and calls.claimed("tools", reply[2], reply[3]) == []
    assert r.lrange(keys.queue("tools"), 0, -1) == [b"c2"] and r.hget(keys.job("c2"), keys.F_WORKER) is None
    assert wakes.get_message(timeout=1)["type"] == "message"  # the others are told
    # Alone on the queue (peers 1) the same worker takes: 1 * 1 < 2.
    reply = calls.transition(CallInfo.of(env("c1"), CKEY), State.CANCELLED, attempt=1, fence=False, ttl=60, take=[*calls.claim_args("tools", 1, "w1", 30), 1, 1])
    assert [c.call_id for c in calls.claimed("tools", reply[2], reply[3])] == ["c2"]
    wakes.close()


def test_claim_reads_queues_in_priority_order(fake: Any) -> None:
    calls = Calls(fake)
    submit(calls, env("low", queue="bulk"))
    submit(calls, env("high", queue="tools"))
    assert [c.call_id for c in calls.claim(["tools", "bulk"], 2, "w", 30)] == ["high", "low"]
    assert calls.claim(["tools", "bulk"], 2, "w", 30) == []


def test_claim_skips_cancelled_calls_and_drops_them_from_the_queue(fake: Any) -> None:
    calls = Calls(fake)
    for i in range(4):
        submit(calls, env(f"c{i}"))
    for cid in ("c1", "c2"):
        info = CallInfo.of(env(cid), CKEY)
        assert calls.transition(info, State.CANCELLED, attempt=1, fence=False)[0] > 0
    got = calls.claim(["tools"], 10, "w", 30)
    assert [c.call_id for c in got] == ["c0", "c3"]
    assert fake.llen(keys.queue("tools")) == 0
    assert fake.zcard(keys.waiting("{tools}", CKEY)) == 0
    assert fake.zscore(keys.leases("{tools}"), "c1") is None
    assert fake.hget(keys.job("c1"), keys.F_WORKER) is None
    assert fake.hget(keys.job("c1"), keys.F_STATE) == b"cancelled"


def test_claim_drops_ids_whose_record_expired(fake: Any) -> None:
    calls = Calls(fake)
    submit(calls, env("c0"))
    submit(calls, env("c1"))
    fake.delete(keys.job("c0"))
    assert [c.call_id for c in calls.claim(["tools"], 10, "w", 30)] == ["c1"]


def test_extend_leases_only_touches_calls_still_leased(fake: Any) -> None:
    calls = Calls(fake)
    fake.zadd(keys.leases("{tools}"), {"mine": 1.0})
    calls.extend_leases([CallInfo.of(env("mine"), CKEY), CallInfo.of(env("gone"), CKEY)], 30)
    assert fake.zscore(keys.leases("{tools}"), "mine") > time.time() + 29
    assert fake.zscore(keys.leases("{tools}"), "gone") is None


def test_reap_returns_only_expired_leases_and_takes_them_over(fake: Any) -> None:
    calls = Calls(fake)
    for cid in ("old", "fresh"):
        submit(calls, env(cid))
    got = calls.claim(["tools"], 2, "w", 30)
    assert len(got) == 2
    info = CallInfo.of(env("old"), CKEY)
    calls.transition(info, State.ROUTING, attempt=1)
    fake.hset(keys.job("old"), keys.F_CANCEL, "1")
    fake.zadd(keys.leases("{tools}"), {"old": time.time() - 1, "vanished": time.time() - 1})
    reaped = calls.reap(["tools"], lease=10)
    assert reaped == [
        {
            "call_id": "old",
            "state": "routing",
            "attempt": 1,
            "max_attempts": 3,
            "queue": keys.queue("tools"),
            "cancel": True,
            "ckey": CKEY,
        }
    ]
    assert fake.zscore(keys.leases("{tools}"), "old") > time.time() + 9  # one reaper owns it now
    assert fake.zscore(keys.leases("{tools}"), "vanished") is None  # no record: nothing to settle
    assert calls.reap(["tools"], lease=10) == []  # a second reaper finds nothing


def test_record_of_an_unknown_call_is_none(fake: Any) -> None:
    assert Calls(fake).record("nope") is None


def test_lease_and_waiting_scores_are_integers_so_small_sorted_sets_store_no_decimals(conn: redis.Redis) -> None:
    calls = Calls(conn)
    for i in range(3):
        submit(calls, env(f"c{i}"), concurrency=1)  # c0 takes the slot, c1 and c2 wait
    calls.claim(["tools"], 1, "w", 30)
    calls.extend_leases([CallInfo.of(env("c0"), CKEY)], 30)
    for key in (keys.leases("{tools}"), keys.slots("{tools}", CKEY), keys.waiting("{tools}", CKEY)):
        scores = [s for _, s in conn.zrange(key, 0, -1, withscores=True)]
        assert scores and all(s.is_integer() for s in scores), (key, scores)
        assert conn.object("encoding", key) == b"listpack"
    waiting = conn.zrange(keys.waiting("{tools}", CKEY), 0, -1, withscores=True)
    assert [m for m, _ in waiting] == [b"c1", b"c2"] and waiting[0][1] <= waiting[1][1]  # still in order


def test_an_ended_llm_call_keeps_the_request_its_model_was_sent_and_an_ended_tool_call_no_envelope(
    fake: Any,
) -> None:
    calls = Calls(fake)
    llm = Envelope(
        call_id="l1", kind="llm", traceparent=TP, queue="tools", channel="hermes:ch:test",
        request={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
    )
    calls.submit(llm, ckey="llm:m1", queue_size=-1, max_attempts=1, timeout=5)
    submit(calls, env("t1", city="x"))
    calls.transition(CallInfo.of(llm, "llm:m1"), State.CANCELLED, attempt=1, fence=False, ttl=600)
    calls.transition(CallInfo.of(env("t1"), CKEY), State.CANCELLED, attempt=1, fence=False, ttl=600)
    kept = calls.record("l1")
    assert kept is not None and kept["state"] == "cancelled" and kept["envelope"].request == llm.request
    ended_tool = calls.record("t1")
    assert ended_tool is not None and ended_tool["state"] == "cancelled" and ended_tool["envelope"] is None
    assert fake.hget(keys.job("t1"), "data") is None and fake.hget(keys.job("t1"), "h_tool") == b"echo"
