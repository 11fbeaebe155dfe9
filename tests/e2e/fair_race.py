"""Fair dispatch under racing submitter processes, shared by the plain-Redis and the cluster test.

Batch submitters (one process each, their own fairness key, class ``batch``) and agents (interactive)
submit one tool at once before any worker runs, against a per-key queue size; then a worker runs them and
a latecomer agent's call arrives behind the batch backlog. What is checked comes from Redis (the fair
state, the records and each call's events), never from timing alone.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from typing import Any

from broker import events, keys
from broker.errors import QueueFull

LIMIT, PER_KEY, BATCHES, AGENTS, EACH_BATCH, EACH_AGENT = 3, 30, 3, 2, 50, 8
SECONDS = 0.2  # each call's run: the batch backlog (90 calls) lasts ~6 s on LIMIT slots
QUEUE = "{tools}"
CKEY = "tool:fair"


def _submit(url: str, home: str, who: str, klass: str, n: int, start: Any, out: Any) -> None:
    from hermes_gateway.client import Gateway

    gw = Gateway.connect(url, home=home, embedded_ok=False, check_workers=False)  # (workers start later)
    try:
        items = [{"seconds": SECONDS}] * n
        start.wait()
        if klass == "batch":
            batch = gw.map("fair", items, fairness_key=who, call_class="batch")
            refused = [h.refused for _, h in batch.refused]
            accepted = [h.call_id for h in batch.accepted]
        else:
            accepted, refused = [], []
            for args in items:
                try:
                    accepted.append(gw.call_tool("fair", args, fairness_key=who).call_id)
                except QueueFull as e:
                    refused.append(e)
        assert all(isinstance(e, QueueFull) and e.details.get("fairness_key") == who for e in refused), refused
        out.put((who, accepted, len(refused)))
    finally:
        if gw is not None:
            gw.close()


def _history(conn: Any, cid: str) -> list[Any]:
    return events.history(conn, cid)


def all_done(conn: Any, ids: list[str]) -> bool:
    pipe = conn.pipeline(transaction=False)
    for c in ids:
        pipe.hget(keys.job(c), keys.F_STATE)
    return all(s == b"done" for s in pipe.execute())


def fair_race(url: str, home: Any, workers: Any, wait_until: Any) -> None:
    from hermes_gateway.client import Gateway

    home.sleep_tool("fair", concurrency=LIMIT, queue_size=1000, timeout=60)
    home.config({"fairness": {"queue_size_per_key": PER_KEY}})
    with Gateway.connect(url, home=str(home.path), embedded_ok=False) as setup:
        setup.sync_tools()  # (closed before forking: no thread of it in the children)
    ctx = multiprocessing.get_context("fork")
    gw = None
    try:
        who = [(f"batch-{i}", "batch", EACH_BATCH) for i in range(BATCHES)]
        who += [(f"agent-{i}", "interactive", EACH_AGENT) for i in range(AGENTS)]
        start, out = ctx.Barrier(len(who)), ctx.Queue()
        procs = [ctx.Process(target=_submit, args=(url, str(home.path), w, k, n, start, out)) for w, k, n in who]
        for p in procs:
            p.start()
        results = {w: (acc, refused) for w, acc, refused in (out.get(timeout=60) for _ in procs)}
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
        gw = Gateway.connect(url, home=str(home.path), embedded_ok=False)
        conn = gw.conn
        running = conn.zcard(keys.slots(QUEUE, CKEY))
        fair = {k.decode(): int(v) for k, v in conn.hgetall(keys.fair(QUEUE, CKEY)).items() if k.startswith(b"n:")}
        # No worker yet: exactly LIMIT hold a slot, each key has at most PER_KEY waiting, and every
        # refusal was a key at its bound (a batch key: 50 submitted, 30 wait, the rest hold a slot or
        # were refused; no agent was refused).
        assert running == LIMIT
        for w, klass, n in who:
            accepted, refused = results[w]
            waiting = fair.get(f"n:{'b' if klass == 'batch' else 'i'}:{w}", 0)
            holding = sum(1 for c in accepted if conn.zscore(keys.slots(QUEUE, CKEY), c) is not None)
            assert waiting <= PER_KEY and waiting + holding == len(accepted) and len(accepted) + refused == n, w
            assert refused == 0 or waiting == PER_KEY, w
        assert sum(results[f"agent-{i}"][1] for i in range(AGENTS)) == 0
        assert sum(fair.values()) + running == sum(len(a) for a, _ in results.values())

        workers(1, queues="tools", concurrency=8)
        agents = [c for i in range(AGENTS) for c in results[f"agent-{i}"][0]]
        wait_until(lambda: all_done(conn, agents), 60, message="agents done")
        backlog = conn.zcard(keys.waiting_batch(QUEUE, CKEY))
        assert backlog > 10, backlog  # the batch still has a backlog when the latecomer comes
        late = gw.call_tool("fair", {"seconds": SECONDS}, fairness_key="latecomer")
        batch = [c for i in range(BATCHES) for c in results[f"batch-{i}"][0]]
        every = [*agents, *batch, late.call_id]
        wait_until(lambda: all_done(conn, every), 90, message="all done")

        hist = {c: _history(conn, c) for c in every}
        # Each call ran once; never more than LIMIT at once.
        assert all(Counter(e.state for e in h)["executing"] == 1 for h in hist.values())
        spans = [(next(e.ts for e in h if e.state == "executing"), next(e.ts for e in h if e.state == "formatting")) for h in hist.values()]
        marks = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
        peak = now = 0
        for _, d in marks:
            now += d
            peak = max(peak, now)
        assert peak <= LIMIT
        # The latecomer started within one round of slots behind the batch backlog: of the calls started
        # after it was submitted, at most LIMIT (already given slots) + 1 (a batch turn) + 1 went first.
        submitted = next(e.ts for e in hist[late.call_id] if e.state == "pending")
        started = next(e.ts for e in hist[late.call_id] if e.state == "routing")
        ahead = [c for c in batch if submitted < next(e.ts for e in hist[c] if e.state == "routing") < started]
        assert len(ahead) <= LIMIT + 2, (len(ahead), backlog)
        # Everything ended: no waiting call, no fair state left.
        assert conn.exists(keys.fair(QUEUE, CKEY), keys.waiting(QUEUE, CKEY), keys.waiting_batch(QUEUE, CKEY)) == 0
    finally:
        if gw is not None:
            gw.close()
