"""A batch cancelled while its submitter starts stays cancelled (real Redis, no worker)."""

from __future__ import annotations

from typing import Any

from broker import keys
from hermes_gateway.batches import BatchStore, Submitter


def test_a_cancel_before_the_submitters_first_chunk_is_not_undone(gateway: Any, home: Any, conn: Any) -> None:
    home.echo_tool()
    gateway.sync_tools()
    store = BatchStore(gateway.conn)
    batch_id = store.create("echo", ["tools"], ttl=60, window=10)
    # The submitter has read the batch (its thread is starting) when the cancel comes.
    submitter = Submitter(store, gateway, batch_id, store.meta(batch_id), resume=False, context={})
    store.cancel(gateway, batch_id)
    submitter.run([{"i": i} for i in range(5)])
    assert store.progress(batch_id).state == "cancelled"
    assert conn.llen(keys.queue("tools")) == 0  # and none of its items went out
