"""Poison records: one call record that does not convert in a claim, reap or due batch is settled alone
(failed with a typed error, or dropped), and the other calls of the batch go on (issue 24.3). Real Redis."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import redis

from broker import events, keys
from broker.calls import Calls
from broker.limits import Limits
from broker.states import State
from tests.broker.test_calls import CKEY, env, submit
from tests.conftest import wait_until

TAG = keys.tag("tools")  # (the calls' ids here carry no tag: their records say their queue)


def _events(conn: redis.Redis, call_id: str) -> list[events.Event]:
    return events.history(conn, call_id)


def _error(conn: redis.Redis, call_id: str) -> dict[str, Any]:
    rec = Calls(conn).record(call_id)
    assert rec is not None
    return rec["error"] or {}


def test_a_claim_batch_with_one_unreadable_attempt_hands_out_every_other_call(conn: redis.Redis) -> None:
    calls = Calls(conn)
    ids = [f"c{i:02d}" for i in range(21)]
    # A channel of this test's own: pub/sub spans every db of the server, so another test (an xdist
    # worker on another db) publishing on the helpers' "hermes:ch:test" meanwhile must not be heard here.
    channel = "hermes:ch:test-poison-claim"
    for cid in ids:
        submit(calls, dataclasses.replace(env(cid, n=1), channel=channel))
    conn.hset(keys.job("c05"), keys.F_ATTEMPT, "not-a-number")
    pubsub = conn.pubsub()
    pubsub.subscribe(channel)
    claimed = calls.claim(["tools"], 25, "w1", 30)
    assert sorted(c.call_id for c in claimed) == [cid for cid in ids if cid != "c05"]
    # The bad one alone: failed with a typed error, its caller told, its lease and slot gone.
    rec = calls.record("c05")
    assert rec is not None and rec["state"] == "failed"
    assert _error(conn, "c05")["type"] == "bad_payload"
    assert "h_attempt='not-a-number'" in _error(conn, "c05")["message"]
    assert [e.state for e in _events(conn, "c05")] == ["failed"]  # (an ended call keeps its last event)
    assert conn.zscore(keys.leases(TAG), "c05") is None and conn.zscore(keys.slots(TAG, CKEY), "c05") is None
    published = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not published:
        msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if msg is not None:
            published.append(events.decode(msg["data"]))
    assert published and published[0].call_id == "c05" and published[0].state == "failed"
    pubsub.close()
    # The others are leased to the worker as usual.
    assert all(conn.zscore(keys.leases(TAG), c.call_id) is not None for c in claimed)


def test_a_record_with_nothing_to_publish_on_is_dropped_alone(conn: redis.Redis) -> None:
    calls = Calls(conn)
    for cid in ("a", "b", "c"):
        submit(calls, env(cid))
    conn.hset(keys.job("b"), keys.F_ATTEMPT, "x")
    conn.hdel(keys.job("b"), keys.F_CHANNEL)
    claimed = calls.claim(["tools"], 10, "w1", 30)
    assert [c.call_id for c in claimed] == ["a", "c"]
    assert conn.zscore(keys.leases(TAG), "b") is None and conn.zscore(keys.slots(TAG, CKEY), "b") is None


def test_a_reap_batch_with_one_unreadable_record_settles_the_others(conn: redis.Redis) -> None:
    calls = Calls(conn)
    ids = [f"r{i}" for i in range(6)]
    for cid in ids:
        submit(calls, env(cid))
    assert len(calls.claim(["tools"], 10, "w-dead", 0.05)) == 6
    conn.hset(keys.job("r2"), keys.F_MAX_ATTEMPTS, "lots")
    conn.hset(keys.job("r4"), keys.F_ATTEMPT, "-")
    # The leases' deadline (whole seconds, so up to a second away) passed: the reaper's cut-off is time.time().
    deadline = max(score for _, score in conn.zrange(keys.leases(TAG), 0, -1, withscores=True))
    wait_until(lambda: time.time() > deadline, timeout=5, message="the leases to run out")
    expired = calls.reap(["tools"], 30)
    assert sorted(item["call_id"] for item in expired) == ["r0", "r1", "r3", "r5"]
    for bad in ("r2", "r4"):
        assert calls.record(bad)["state"] == "failed"  # type: ignore[index]
        assert _error(conn, bad)["type"] == "bad_payload"
        assert conn.zscore(keys.leases(TAG), bad) is None


def test_a_due_retry_batch_with_one_unreadable_record_hands_out_the_others(conn: redis.Redis) -> None:
    calls = Calls(conn)
    for cid in ("d1", "d2", "d3"):
        submit(calls, env(cid))
        conn.hset(keys.job(cid), keys.F_STATE, str(State.RETRYING))
        conn.zadd(keys.scheduled(TAG), {cid: time.time() - 1})
    conn.hset(keys.job("d2"), keys.F_ATTEMPT, "2x")
    due, _ = Limits(conn).due(["tools"], 30)
    assert sorted(d.call_id for d in due) == ["d1", "d3"]
    assert calls.record("d2")["state"] == "failed"  # type: ignore[index]
    assert conn.zscore(keys.scheduled(TAG), "d2") is None


def test_a_damaged_record_still_reads(conn: redis.Redis) -> None:
    calls = Calls(conn)
    submit(calls, env("z"))
    conn.hset(keys.job("z"), keys.F_ATTEMPT, "zz")
    rec = calls.record("z")
    assert rec is not None and rec["attempt"] == 0 and rec["state"] == "pending"


def test_a_queued_id_without_a_record_is_dropped_and_a_scheduled_one_leaves_the_schedule(conn: redis.Redis) -> None:
    # (on a cluster, a record mid-migration is asked for again where redirections are followed and kept:
    # tests/e2e/test_cluster.py moves a queue's slot under a batch)
    calls = Calls(conn)
    submit(calls, env("kept"))
    conn.lpush(keys.queue("tools"), "expired")  # an id whose record is gone
    conn.zadd(keys.scheduled(TAG), {"expired-retry": time.time() - 1})
    claimed = calls.claim(["tools"], 10, "w1", 30)
    assert [c.call_id for c in claimed] == ["kept"]
    assert conn.llen(keys.queue("tools")) == 0 and conn.zscore(keys.leases(TAG), "expired") is None
    due, _ = Limits(conn).due(["tools"], 30)
    assert due == [] and conn.zscore(keys.scheduled(TAG), "expired-retry") is None


def test_dropped_ids_warn_once_each_up_to_a_burst_a_window_then_count_the_rest(monkeypatch: Any) -> None:
    import structlog.testing

    from broker import calls

    now = [100.0]
    monkeypatch.setattr(calls.time, "monotonic", lambda: now[0])
    dropped = calls.DroppedIds(burst=2, window=60.0)
    with structlog.testing.capture_logs() as logged:
        for i in range(5):
            dropped.warn("tools", f"junk-{i}".encode())
        now[0] += 61.0
        dropped.warn("tools", b"x" * 100)
    assert [e["call_id"] for e in logged] == ["junk-0", "junk-1", "x" * 40 + "..."]
    assert all(e["queue"] == "tools" and e["log_level"] == "warning" for e in logged)
    assert "suppressed_before" not in logged[1] and logged[2]["suppressed_before"] == 3
