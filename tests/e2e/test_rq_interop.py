"""RQ's own tools see Hermes workers, queues and calls."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from rq import Queue, Worker
from rq.job import Job

from broker.codec import MsgpackSerializer

pytestmark = pytest.mark.e2e


def rq_info(url: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "rq.cli", "info", "--url", url], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_rq_info_lists_our_workers_and_queues(
    gateway: Any, home: Any, workers: Any, redis_url: str, conn: Any
) -> None:
    home.sleep_tool()
    gateway.sync_tools()
    waiting = [gateway.call_tool("sleep", {"seconds": 0.1}) for _ in range(3)]
    text = rq_info(redis_url)
    assert "{tools}" in text and "3 jobs total" in text  # (queues are named by their hash tag)  # queued before any worker runs

    started = workers(2, concurrency=4, queues="tools")
    for h in waiting:
        assert h.result(timeout=10) == {"slept": 0.1}
    text = rq_info(redis_url)
    for w in started:
        assert w.name in text
    assert "2 workers" in text
    assert text.count(" {tools}") >= 2  # each worker line names the queue it listens on

    # The RQ API agrees: our workers are RQ workers on the queue, our calls are RQ jobs.
    rq_workers = Worker.all(connection=conn)
    assert {w.name for w in started} <= {w.name for w in rq_workers}
    assert all(
        [q.name for q in w.queues] == ["{tools}"] for w in rq_workers if w.name in {s.name for s in started}
    )
    # (RQ's Job.fetch refuses ids with braces; a call id carries its queue's hash tag: its hash is read
    # at RQ's own key for it)
    job_key = Job.key_for(waiting[0].call_id)
    assert conn.hget(job_key, "status") == b"finished"  # (an ended call keeps RQ's status, not its worker_name)
    assert Queue("{tools}", connection=conn, serializer=MsgpackSerializer).count == 0


def test_rq_sees_an_idle_worker_as_idle_and_a_working_one_as_busy(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    home.sleep_tool()
    gateway.sync_tools()
    (started,) = workers(1, lease=0.6)  # (a heartbeat every 0.2 s)

    def state() -> str:  # read back by RQ's own Worker.all, as `rq info` does
        return next(w.get_state() for w in Worker.all(connection=conn) if w.name == started.name)

    assert state() == "idle"
    call = gateway.call_tool("sleep", {"seconds": 3})
    wait_until(lambda: state() == "busy", timeout=5, message="rq to see the worker busy")
    assert call.result(timeout=10) == {"slept": 3}
    wait_until(lambda: state() == "idle", timeout=5, message="rq to see the worker idle again")
    assert "idle" in rq_info(gateway.broker.url) and "busy" not in rq_info(gateway.broker.url)
