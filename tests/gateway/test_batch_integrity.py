"""A batch's record stays true through resumes, dead submitters, expiry and failures (real Redis, no worker:
calls stay pending unless the test cancels them)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from broker import keys
from broker.codec import text
from broker.errors import InvalidArgs, NoWorkers, UnknownBatch
from hermes_gateway.batches import SENDING_STALE, BatchStore, Submitter, item_call_id


@pytest.fixture
def store(gateway: Any, home: Any) -> BatchStore:
    home.echo_tool()
    gateway.sync_tools()
    return BatchStore(gateway.conn)


def _pending(conn: Any, batch_id: str, indexes: range) -> list[int]:
    return [
        i
        for i in indexes
        if conn.hget(keys.job(keys.call_id("tools", item_call_id(batch_id, i))), "h_state") == b"pending"
    ]


def test_a_resume_never_lowers_the_high_water_mark_and_a_cancel_then_reaches_every_call(
    gateway: Any, store: BatchStore, conn: Any
) -> None:
    batch_id = store.create("echo", ["tools"], ttl=60, window=100)
    items = [{"i": i} for i in range(40)]
    first = Submitter(store, gateway, batch_id, store.meta(batch_id), resume=False, context={})
    first.send(list(enumerate(items))[:20])
    first.send(list(enumerate(items))[20:])  # (then its process dies: no total, still submitting)
    for i in range(20):  # the first 20 end
        gateway.cancel(keys.call_id("tools", item_call_id(batch_id, i)))
    seen = []
    real = Submitter.begin

    def begin(self: Submitter, end: int) -> bool:
        seen.append(store.progress(batch_id).submitted)
        return real(self, end)

    resumer = Submitter(store, gateway, batch_id, store.meta(batch_id), resume=True, context={})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Submitter, "begin", begin)
        resumer.run(items)
    assert seen and min(seen) == 40  # (the all-ended first chunk used to write it back to 0)
    p = store.progress(batch_id)
    assert p.submitted == 40 and p.total == 40 and not p.complete  # 20 calls still pending
    assert store.cancel(gateway, batch_id) == 20
    assert _pending(conn, batch_id, range(40)) == [] and store.progress(batch_id).complete


def test_a_resume_is_refused_when_the_tool_is_split_over_other_queues_now(
    gateway: Any, store: BatchStore
) -> None:
    batch_id = store.create("echo", ["tools#0.0", "tools#1.0"], ttl=60, window=10)
    with pytest.raises(InvalidArgs, match="split over other queues"):
        gateway.batch("echo", [{"i": 1}], resume=batch_id)
    assert store.meta(batch_id)["state"] == "submitting"  # (untouched)


def test_a_cancelled_batch_is_not_resumed_and_its_state_is_never_overwritten(
    gateway: Any, store: BatchStore
) -> None:
    batch_id = store.create("echo", ["tools"], ttl=60, window=10)
    store.cancel(gateway, batch_id)
    assert store.set_state(batch_id, "submitted", 60, total=3) == "cancelled"
    assert store.meta(batch_id)["state"] == "cancelled" and "total" not in store.meta(batch_id)
    with pytest.raises(InvalidArgs, match="cancelled"):
        gateway.batch("echo", [{"i": 1}], resume=batch_id)


def test_a_cancel_after_the_submitter_died_mid_chunk_reaches_its_calls_and_its_unsent_items(
    gateway: Any, store: BatchStore, conn: Any
) -> None:
    batch_id = store.create("echo", ["tools"], ttl=60, window=100)
    dead = Submitter(store, gateway, batch_id, store.meta(batch_id), resume=False, context={})
    assert dead.begin(20)
    dead.send_chunk([(i, {"i": i}) for i in range(12)])  # 12 of its 20 went out, then it died
    conn.hset(keys.batch(batch_id), "sending", f"{time.time() - SENDING_STALE - 1} 20")  # (long ago)
    p = store.progress(batch_id)
    assert p.submitted == 20 and not p.complete  # its chunk counts: those calls may be running
    assert store.cancel(gateway, batch_id) == 12
    p = store.progress(batch_id)
    assert p.complete and p.counts == {"cancelled": 20} and _pending(conn, batch_id, range(20)) == []
    ended = sorted(item.index for page in store.pages(batch_id, False, lambda: True) for item in page)
    assert ended == list(range(20))


def test_a_batch_past_its_ttl_stops_its_submitter_and_leaves_no_key_without_a_ttl(
    gateway: Any, store: BatchStore, conn: Any
) -> None:
    batch_id = store.create("echo", ["tools"], ttl=60, window=100)
    submitter = Submitter(store, gateway, batch_id, store.meta(batch_id), resume=False, context={})
    conn.delete(keys.batch(batch_id))  # (its TTL ran out while it was being submitted)
    submitter.run([{"i": i} for i in range(30)])
    assert conn.llen(keys.queue("tools")) == 0
    assert conn.ttl(keys.batch(batch_id)) != -1
    conn.hset(keys.batch(batch_id), "submitted", 5)  # a late write's remains, as an older tree left them
    with pytest.raises(UnknownBatch):
        store.progress(batch_id)
    assert batch_id not in {p.id for p in store.recent()}  # (and the list still answers)


def test_a_failed_submitter_leaves_the_batch_stopped_with_its_error(
    gateway: Any, store: BatchStore, monkeypatch: Any
) -> None:
    def no_workers(queues: Any) -> None:
        raise NoWorkers("no live worker listens on tools")

    monkeypatch.setattr(gateway.workers, "ensure", no_workers)
    job = gateway.batch("echo", [{"i": 1}])
    with pytest.raises(NoWorkers):
        job.wait(10)
    d = store.progress(job.id).to_dict()
    assert d["state"] == "stopped" and d["complete"] and "NoWorkers" in d["error"]


def test_a_short_ttl_batch_does_not_drop_live_batches_from_the_list(store: BatchStore, conn: Any) -> None:
    long_lived = store.create("echo", ["tools"], ttl=86400, window=10)
    gone = store.create("echo", ["tools"], ttl=60, window=10)
    conn.zadd(keys.BATCHES, {long_lived: time.time() - 100, gone: time.time() - 100})
    conn.delete(keys.batch(gone))
    store.create("echo", ["tools"], ttl=10, window=10)
    listed = conn.zrange(keys.BATCHES, 0, -1)
    assert long_lived.encode() in listed and gone.encode() not in listed


def test_gone_batches_leave_the_list_behind_long_lived_ones_at_its_head(store: BatchStore, conn: Any) -> None:
    long_ago = time.time() - 1000
    alive = [store.create("echo", ["tools"], ttl=86400, window=10) for _ in range(25)]
    gone = [store.create("echo", ["tools"], ttl=60, window=10) for _ in range(15)]
    conn.zadd(keys.BATCHES, {bid: long_ago - 1 for bid in alive})  # the oldest: still running
    conn.zadd(keys.BATCHES, dict.fromkeys(gone, long_ago))
    conn.delete(*(keys.batch(bid) for bid in gone))
    for _ in range(60):
        store.create("echo", ["tools"], ttl=60, window=10)
    listed = {text(bid) for bid in conn.zrange(keys.BATCHES, 0, -1)}
    assert set(alive) <= listed and not set(gone) & listed  # (20 at a time from the oldest never got past them)


def test_a_null_item_is_a_failed_item_not_a_call(gateway: Any, store: BatchStore, conn: Any) -> None:
    batch_id = store.create("echo", ["tools"], ttl=60, window=10)
    Submitter(store, gateway, batch_id, store.meta(batch_id), resume=False, context={}).run([None, {"i": 1}])
    items = {x.index: x for page in store.pages(batch_id, False, lambda: True) for x in page}
    assert items[0].state == "failed" and items[0].error["type"] == "invalid_args"
    assert conn.llen(keys.queue("tools")) == 1  # only the real item became a call
