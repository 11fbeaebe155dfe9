"""The partition race, shared by the plain-Redis and the cluster test: many clients submit a tool split in
3 partitions at once; the limit and the queue size hold exactly across the partitions."""

from __future__ import annotations

import threading
from typing import Any

from broker import events, keys
from broker.errors import QueueFull

LIMIT, QUEUE_SIZE, PARTS = 5, 7, 3


def race(url: str, home: Any, workers: Any, wait_until: Any, clients: int = 6, each: int = 10) -> None:
    from hermes_gateway.client import Gateway

    home.sleep_tool("split", concurrency=LIMIT, queue_size=QUEUE_SIZE, queue_partitions=PARTS, timeout=60)
    gws = [Gateway.connect(url, home=str(home.path), embedded_ok=False) for _ in range(clients)]
    try:
        gws[0].sync_tools()
        workers(2, queues="tools", concurrency=16)
        accepted: list[str] = []
        refused = []
        lock = threading.Lock()
        start = threading.Barrier(clients)

        def submit(gw: Any) -> None:
            start.wait()
            for _ in range(each):
                try:
                    h = gw.call_tool("split", {"seconds": 2.0})
                except QueueFull as e:
                    with lock:
                        refused.append(e)
                    continue
                with lock:
                    accepted.append(h.call_id)

        threads = [threading.Thread(target=submit, args=(gw,)) for gw in gws]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        conn = gws[0].conn
        tags = [keys.tag(q) for q in keys.partition_names("tools", PARTS)]
        ckey = "tool:split"
        running = sum(conn.zcard(keys.slots(t, ckey)) for t in tags)
        waiting = sum(conn.zcard(keys.waiting(t, ckey)) + conn.zcard(keys.waiting_batch(t, ckey)) for t in tags)
        ended = sum(gws[0].calls.record(c)["state"] == "done" for c in accepted)  # (read after: only grows)
        # Every partition's share is taken and no more: the limit plus the queue size accepted — and one more
        # per call that ended meanwhile (on a loaded machine the race can outlast a 2 s call), never beyond.
        assert LIMIT + QUEUE_SIZE <= len(accepted) <= LIMIT + QUEUE_SIZE + ended, (len(accepted), len(refused), ended)
        assert running <= LIMIT and waiting <= QUEUE_SIZE and running + waiting >= len(accepted) - ended
        assert {keys.tag_in(cid) for cid in accepted} == set(tags)  # spread over every partition
        wait_until(
            lambda: all(gws[0].calls.record(c)["state"] == "done" for c in accepted), 60, message="every call done"
        )
        spans = []
        for cid in accepted:
            hist = events.history(conn, cid)
            spans.append((next(e.ts for e in hist if e.state == "executing"), next(e.ts for e in hist if e.state == "formatting")))
        marks = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
        peak = now = 0
        for _, d in marks:
            now += d
            peak = max(peak, now)
        assert peak <= LIMIT
    finally:
        for gw in gws:
            gw.close()
