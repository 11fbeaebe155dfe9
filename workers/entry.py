"""The RQ job function of every call: ``rq worker --serializer broker.codec.MsgpackSerializer tools`` runs
calls one at a time through the same runner (Hermes workers do not call this)."""

from __future__ import annotations

from typing import Any

from broker.codec import pack


def run_call(envelope: dict[str, Any]) -> Any:
    """Run one call synchronously inside a stock RQ worker and return its result."""
    from rq import get_current_job

    from broker.calls import Claimed
    from broker.config import load_settings
    from broker.settings import configure_shortcuts
    from workers.runner import CallRunner, WorkerCore

    job = get_current_job()
    if job is None:
        raise RuntimeError("run_call must run inside an RQ job")
    conn = job.connection
    settings = load_settings()
    configure_shortcuts(settings.workers.shortcuts_off)
    core = WorkerCore(conn, settings, job.worker_name or "rq-worker")
    try:
        data = pack(["workers.entry.run_call", None, [envelope], {}])
        CallRunner(core).run(Claimed(job.id, data, int(conn.hget(job.key, "h_attempt") or 1)))
    finally:
        core.close()
    return (core.calls.record(job.id) or {}).get("result")
