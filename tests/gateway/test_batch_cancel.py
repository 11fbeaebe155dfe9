"""A batch cancelled while its submitter starts stays cancelled (real Redis, no worker)."""

from __future__ import annotations

from typing import Any

from broker import keys
from hermes_gateway.batches import BatchStore, Submitter


def test_a_cancel_before_the_submitters_first_chunk_is_not_undone(gateway: Any, home: Any, conn: Any) -> None:
    # The submitter has read the batch (its thread is starting) when the cancel comes.
    store, batch_id, submitter = _batch_of_echo(gateway, home)
    store.cancel(gateway, batch_id)
    submitter.run([{"i": i} for i in range(5)])
    assert store.progress(batch_id).state == "cancelled"
    assert conn.llen(keys.queue("tools")) == 0  # and none of its items went out


def _batch_of_echo(gateway: Any, home: Any) -> tuple[BatchStore, str, Submitter]:
    """A batch of the echo tool (window 10) and its submitter, not started."""
    home.echo_tool()
    gateway.sync_tools()
    store = BatchStore(gateway.conn)
    batch_id = store.create("echo", ["tools"], ttl=60, window=10)
    return store, batch_id, Submitter(store, gateway, batch_id, store.meta(batch_id), resume=False, context={})


def _ended(store: BatchStore, batch_id: str) -> list[int]:
    return sorted(item.index for page in store.pages(batch_id, False, lambda: True) for item in page)


def test_a_cancel_while_a_chunk_goes_out_is_not_complete_until_the_chunk_is_counted(
    gateway: Any, home: Any, conn: Any, monkeypatch: Any
) -> None:
    store, batch_id, submitter = _batch_of_echo(gateway, home)
    seen = []
    real = Submitter.submit

    def submit_after_a_cancel(self: Submitter, prepared: list[Any]) -> list[Any]:
        store.cancel(gateway, batch_id)  # the cancel lands between the chunk's mark and its SUBMIT
        seen.append(store.progress(batch_id))
        return real(self, prepared)

    monkeypatch.setattr(Submitter, "submit", submit_after_a_cancel)
    submitter.run([{"i": i} for i in range(25)])
    during = seen[0]
    assert during.state == "cancelled" and during.submitted == 0 and during.sending and not during.complete
    after = store.progress(batch_id)
    # the chunk's 10 calls were accepted, counted, then cancelled by the submitter: each has its result
    assert after.submitted == 10 and not after.sending and after.complete
    assert after.counts == {"cancelled": 10}
    assert _ended(store, batch_id) == list(range(10))


def test_items_waiting_for_room_when_the_batch_is_cancelled_end_cancelled(
    gateway: Any, home: Any, conn: Any, monkeypatch: Any
) -> None:
    store, batch_id, submitter = _batch_of_echo(gateway, home)

    def queue_full_then_cancelled(self: Submitter, prepared: list[Any]) -> list[Any]:
        store.cancel(gateway, batch_id)
        return prepared  # every item refused with QueueFull

    monkeypatch.setattr(Submitter, "submit", queue_full_then_cancelled)
    submitter.run([{"i": i} for i in range(25)])
    p = store.progress(batch_id)
    assert p.complete and p.submitted == 10 and p.counts == {"cancelled": 10}
    items = [item for page in store.pages(batch_id, False, lambda: True) for item in page]
    assert sorted(x.index for x in items) == list(range(10))
    assert all(x.state == "cancelled" and x.error["type"] == "cancelled" for x in items)
    assert conn.llen(keys.queue("tools")) == 0


def test_a_chunk_marked_in_flight_by_a_dead_submitter_stops_counting_after_a_while(
    gateway: Any, conn: Any
) -> None:
    import time

    from hermes_gateway.batches import SENDING_STALE

    store = BatchStore(gateway.conn)
    batch_id = store.create("echo", ["tools"], ttl=60, window=10)
    conn.hset(keys.batch(batch_id), mapping={"state": "cancelled", "sending": time.time()})
    assert not store.progress(batch_id).complete
    conn.hset(keys.batch(batch_id), "sending", time.time() - SENDING_STALE - 1)
    assert store.progress(batch_id).complete
