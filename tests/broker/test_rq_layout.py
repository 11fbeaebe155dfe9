"""RQ's job-hash layout, which ours is (a call's record is an RQ job hash with our ``h_*`` fields beside
RQ's, waiting on RQ's queue lists): each thing we write as RQ writes it is checked against the installed
RQ, so an upgrade that changes one fails here, not in ``rq info``. rq is pinned (pyproject.toml) to the
minor version these cover; tests/e2e/test_rq_interop.py shows RQ's own tools reading a live system."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.worker import Worker

from broker import keys
from broker.calls import RQ_FUNC, job_fields, rq_time
from broker.codec import MsgpackSerializer
from broker.envelope import Envelope
from broker.states import RQ_STATUS


def _envelope() -> Envelope:
    return Envelope(
        call_id="rqlayout1",
        kind="tool",
        tool="echo",
        args={"a": 1},
        queue="tools",
        channel="hermes:ch:t",
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )


def test_our_job_queue_and_registry_keys_are_rqs() -> None:
    assert Job.key_for("x") == keys.RQ_JOB.format("x").encode() or Job.key_for("x") == keys.RQ_JOB.format("x")
    assert Queue.redis_queue_namespace_prefix == keys.RQ_QUEUE.format("")
    assert Queue.redis_queues_keys == keys.RQ_QUEUES


def test_every_rq_field_we_write_is_one_rq_writes_for_a_job() -> None:
    ours = {
        k
        for k in job_fields(_envelope(), ckey="tool:echo", max_attempts=1, timeout=5)
        if not k.startswith("h_")
    }
    job = Job.create(
        print, connection=redis.Redis(), serializer=MsgpackSerializer, timeout=5, result_ttl=9, failure_ttl=9
    )
    job.origin, job.enqueued_at = "tools", datetime.now(UTC)  # (what Queue.enqueue_job sets)
    assert ours <= set(job.to_dict()) | {"status"}, ours - set(job.to_dict())


def test_every_status_we_write_is_an_rq_job_status() -> None:
    assert {s for s in RQ_STATUS.values() if s} <= {s.value for s in JobStatus}
    assert "queued" == JobStatus.QUEUED.value  # (submit.lua writes it)


def test_rq_reads_our_job_hash_its_function_origin_and_times(conn: redis.Redis) -> None:
    env = _envelope()
    fields = job_fields(env, ckey="tool:echo", max_attempts=1, timeout=5)
    conn.hset(keys.job(env.call_id), mapping={**fields, "status": "queued"})
    job = Job(env.call_id, connection=conn, serializer=MsgpackSerializer)
    job.refresh()
    assert job.func_name == RQ_FUNC and job.origin == "tools" and job.get_status() == JobStatus.QUEUED
    assert (
        job.enqueued_at is not None
        and rq_time(job.enqueued_at.timestamp())[:19] == fields["enqueued_at"][:19]
    )
    assert job.timeout == fields["timeout"]


def test_rq_counts_a_call_we_queue_on_its_queue_list(conn: redis.Redis) -> None:
    conn.rpush(keys.RQ_QUEUE.format("rqlayout"), "rqlayout1")
    assert Queue("rqlayout", connection=conn, serializer=MsgpackSerializer).count == 1


def test_the_worker_api_the_process_uses_is_there() -> None:
    rq_worker: Any = Worker
    for name in ("register_birth", "register_death", "heartbeat", "set_state"):
        assert callable(getattr(rq_worker, name)), name
    assert "pipeline" in __import__("inspect").signature(Worker.heartbeat).parameters
