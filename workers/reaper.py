"""Settling calls whose worker died: retried while attempts are left, else failed with a reason."""

from __future__ import annotations

from typing import Any

import structlog

from broker import keys, pipes
from broker.audit import AuditLog, AuditRecord
from broker.calls import CallInfo, Calls, failure_entry, push_failure, stats_name
from broker.codec import text
from broker.errors import WorkerLost
from broker.otel import new_span_id
from broker.states import ACTIVE, State

log = structlog.get_logger("hermes.reaper")

_SETTLE_PATIENCE = 5.0  # seconds a settling write waits out a moving cluster slot (the entry is held a lease)


def reap(calls: Calls, queues: list[str], lease: float, result_ttl: int, audit: AuditLog | None = None) -> int:
    """Settle every call on ``queues`` whose lease ran out; returns how many were settled."""
    expired = calls.reap(queues, lease)
    for item in expired:
        try:
            _settle(calls, item, result_ttl, audit)
        except Exception:  # noqa: BLE001 - one bad record must not stop the reaper
            log.exception("could not settle expired call", call_id=item["call_id"])
    return len(expired)


def _info(calls: Calls, call_id: str, item: dict[str, Any]) -> CallInfo:
    raw = calls.conn.hmget(
        keys.job(call_id), keys.F_TRACE, keys.F_KIND, keys.F_TOOL, keys.F_CHANNEL, "origin", keys.F_SESSION
    )
    trace, kind, tool, chan, origin, session = (text(v) for v in raw)
    return CallInfo(call_id, trace, new_span_id(), kind, tool, session or None, chan, item["ckey"], origin)


def _settle(calls: Calls, item: dict[str, Any], result_ttl: int, audit: AuditLog | None = None) -> None:
    call_id, state, attempt = item["call_id"], item["state"], item["attempt"]
    # A call being cancelled is not put back: it ends below (one claimed but never started, too: its
    # worker was to stop it, so the caller's cancel left it "pending" for that worker).
    if state in (State.PENDING, State.RETRYING) and not item["cancel"]:
        info = _info(calls, call_id, item)
        if state == State.RETRYING:
            calls.requeue(info, attempt=attempt)
        else:
            # Claimed, no start on record: back at the head of the queue, keeping its slot. Its worker
            # writes its first move behind the start (and a failover may lose that write), so it may have
            # run: the next run is the next attempt, reported as such, and the budget grows by one with it
            # (as for a call handed back at shutdown) so an unstarted call loses nothing.
            name = keys.queue_name(item["queue"])
            tag = keys.tag(name)
            pipe = calls.conn.pipeline(transaction=False)  # (keys of one slot)
            pipe.hincrby(keys.job(call_id), keys.F_ATTEMPT, 1)
            pipe.hincrby(keys.job(call_id), keys.F_MAX_ATTEMPTS, 1)
            pipe.zadd(keys.slots(tag, item["ckey"]), {call_id: "inf"}, xx=True)
            pipe.lpush(item["queue"], call_id)
            pipe.zrem(keys.leases(tag), call_id)
            pipes.settled(pipe, pipes.for_seconds(_SETTLE_PATIENCE))  # (a moving slot: what it refused, again)
            calls.conn.publish(calls.wake_channel(name), b"")
        log.info("requeued call of a lost worker", call_id=call_id, state=state)
        return
    if state not in ACTIVE and state not in (State.RETRYING, State.PENDING):
        calls.conn.zrem(keys.leases(keys.tag(keys.queue_name(item["queue"]))), call_id)
        return
    info = _info(calls, call_id, item)
    current = State(state)
    if item["cancel"]:
        err = {"type": "cancelled", "message": "call cancelled; its worker was lost"}
        end_call(calls, info, State.CANCELLED, current, attempt, err, result_ttl, audit)
    elif attempt < item["max_attempts"]:
        calls.hand_back(info, attempt=attempt, current=current, reason="worker_lost")
        log.warning("worker lost mid-call, retrying", call_id=call_id, attempt=attempt + 1)
    else:
        err = WorkerLost(
            f"the worker running this call was lost {attempt} time(s); no attempts left", attempts=attempt
        ).to_wire()
        end_call(calls, info, State.FAILED, current, attempt, err, result_ttl, audit)
        log.warning("worker lost mid-call, no attempts left", call_id=call_id, attempt=attempt)


def end_call(
    calls: Calls,
    info: CallInfo,
    state: State,
    current: State,
    attempt: int,
    err: dict[str, Any],
    ttl: int,
    audit: AuditLog | None,
) -> None:
    """End the call in ``state`` with ``err``, and write its audit record when this move ended it."""
    reply = calls.finish(info, state, attempt=attempt, current=current, error=err, ttl=ttl)
    if int(reply[0]) <= 0:
        return
    # Counted with the calls the workers ended, and a failure listed with theirs (status's recent failures).
    pipe = calls.conn.pipeline(transaction=False)
    shown = info.kind not in keys.STATS_CAPPED or int(stats_name(calls.conn, info.kind, info.name))
    name = info.name if shown else keys.STATS_OTHER
    pipe.hincrby(keys.STATS, keys.stats_ended(info.kind, name, str(state), err.get("type")), 1)
    if state == State.FAILED:
        push_failure(pipe, failure_entry(info, err, "reaper", None))
    pipes.settled(pipe, pipes.for_seconds(_SETTLE_PATIENCE))
    if audit is None:
        return
    audit.append(
        AuditRecord.of(
            call_id=info.call_id,
            kind=info.kind,
            state=str(state),
            error=err,
            principal=text(calls.conn.hget(keys.job(info.call_id), keys.F_PRINCIPAL)) or None,
            tool_name=info.name if info.kind == "tool" else None,
            model=info.name if info.kind == "llm" else None,
            trace_id=info.trace_id,
            attempts=attempt,
        )
    )

