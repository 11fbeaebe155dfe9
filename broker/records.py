"""What a call's record in Redis holds, apart from the scripts that change it (``broker.calls``).

The RQ job hash with our fields, the envelope inside its ``data``, what every event of a call repeats
(``CallInfo``), a claimed call, and how times go into Redis: RQ's time format, lease deadlines and
waiting places as integer scores.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from . import keys
from .codec import raw as as_bytes
from .codec import text, unpack
from .envelope import Envelope, fairness_of
from .errors import DecodeError
from .states import TERMINAL, State

RQ_FUNC = "workers.entry.run_call"


_SECOND: list[tuple[int, str]] = [(0, "")]  # the last whole second formatted (strftime showed in profiles)


def lease_deadline(seconds: float) -> int:
    """A lease deadline ``seconds`` from now, rounded up to a whole second.

    Leases and held slots live in small sorted sets, which Redis keeps as listpacks: a fractional score is
    printed on every write and parsed back (``strtod``) for every entry a lookup walks past, which showed
    as a tenth of Redis's CPU under load. Whole seconds are stored as integers.
    """
    return math.ceil(time.time() + seconds)


def waiting_score() -> int:
    """Where a call joins the line for a slot: now in whole microseconds (an integer score, see above)."""
    return time.time_ns() // 1000


def rq_time(t: float) -> str:
    """A time in RQ's format (UTC, microseconds)."""
    sec = int(t)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(sec))}.{int((t - sec) * 1_000_000):06d}Z"


def rq_now() -> str:
    """Now in RQ's time format (UTC, microseconds)."""
    t = time.time()
    sec = int(t)
    cached = _SECOND[0]
    if cached[0] != sec:
        cached = (sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)))
        _SECOND[0] = cached
    return f"{cached[1]}.{int((t - sec) * 1_000_000):06d}Z"


@dataclass(frozen=True)
class CallInfo:
    """What every event of a call repeats; built once per call."""

    call_id: str
    trace_id: str
    span_id: str
    kind: str
    name: str
    session_id: str | None
    channel: str
    ckey: str
    queue: str

    @classmethod
    def of(cls, env: Envelope, ckey: str, span_id: str | None = None) -> CallInfo:
        return cls(
            call_id=env.call_id,
            trace_id=env.trace_id,
            span_id=span_id or env.parent_span_id,
            kind=env.kind,
            name=env.name,
            session_id=env.context.get("session_id"),
            channel=env.channel,
            ckey=ckey,
            queue=env.queue,
        )


# A move not written yet: (state, event detail, when it happened).
Step = tuple[State, "dict[str, Any] | None", float]


@dataclass(frozen=True)
class Claimed:
    """A call a worker took from a queue."""

    call_id: str
    data: bytes
    attempt: int


def job_fields(env: Envelope, *, ckey: str, max_attempts: int, timeout: float) -> dict[str, Any]:
    """The RQ job hash (RQ's own fields, so ``rq info``/``Job.fetch`` work) plus ours."""
    stamp = rq_now()
    fkey, klass = fairness_of(env)
    fields = {
        "created_at": stamp,
        "enqueued_at": stamp,
        "data": env.job_data(RQ_FUNC),
        "origin": env.queue,
        "description": f"hermes {env.kind} {env.name}",
        "timeout": int(timeout) + 1,
        "result_ttl": 86400,
        "failure_ttl": 86400,
        "worker_name": "",
        "started_at": "",
        "ended_at": "",
        keys.F_ATTEMPT: 1,
        keys.F_MAX_ATTEMPTS: max_attempts,
        keys.F_CHANNEL: env.channel,
        keys.F_QUEUE: keys.queue(env.queue),
        keys.F_CKEY: ckey,
        keys.F_KIND: env.kind,
        keys.F_TOOL: env.name,
        keys.F_TRACE: env.trace_id,
        keys.F_FKEY: fkey,
        keys.F_CLASS: klass,
    }
    principal = env.context.get("principal")
    if principal:  # (whose call it is, one HGET away for the HTTP API's checks; absent: no principal)
        fields[keys.F_PRINCIPAL] = principal
    return fields


def envelope_of(data: bytes) -> Envelope:
    """Decode the envelope out of the RQ job's ``data`` field."""
    raw = unpack(data)
    if not isinstance(raw, list) or len(raw) != 4 or not isinstance(raw[2], list) or not raw[2]:
        raise DecodeError("job data is not a hermes call")
    return Envelope.from_dict(raw[2][0])


def ending(conn: Any, call_id: str) -> Any:
    """An ended call's terminal event: the one it keeps in place of its history (``keys.ended``), else
    the last terminal one of its whole history (``workers.keep_history``, or a record written before)."""
    from .events import decode, history

    last = conn.get(keys.ended(call_id))
    if last is not None:
        return decode(as_bytes(last), call_id)
    ends = [e for e in history(conn, call_id) if e.terminal]
    return ends[-1] if ends else None


def read_record(conn: Any, call_id: str) -> dict[str, Any] | None:
    """The call's record as plain values (state, attempt, result, error, ...).

    An ended call's hash keeps only what TRANSITION's ``ENDED`` lists; its seq, trace id, end time and
    result or error come from its terminal event (a result too large for the event from ``h_result``), and
    it has no envelope any more (``envelope`` None, ``request_dropped`` True: its audit record keeps the
    arguments, redacted).
    """
    raw = conn.hgetall(keys.job(call_id))
    if not raw:
        return None
    rec = {text(k): v for k, v in raw.items()}
    out: dict[str, Any] = {
        "call_id": call_id,
        "state": text(rec.get(keys.F_STATE)),
        "attempt": _int(rec.get(keys.F_ATTEMPT)),
        "seq": _int(rec.get(keys.F_SEQ)),
        "kind": text(rec.get(keys.F_KIND)),
        "name": text(rec.get(keys.F_TOOL)),
        "trace_id": text(rec.get(keys.F_TRACE)),
        "channel": text(rec.get(keys.F_CHANNEL)),
        "worker": text(rec.get(keys.F_WORKER) or rec.get("worker_name")),
        "queue": text(rec.get("origin")) or keys.tag_in(call_id).strip("{}"),
        "created_at": text(rec.get("created_at")),
        "ended_at": text(rec.get("ended_at")),
    }
    if out["state"] in _ENDED:
        end = ending(conn, call_id)
        if end is not None:
            out["seq"] = max(out["seq"], end.seq)
            out["trace_id"] = out["trace_id"] or end.trace_id
            out["ended_at"] = out["ended_at"] or rq_time(end.ts)
            if "error" in end.detail:
                out["error"] = end.detail["error"]
            if "result" in end.detail:
                out["result"] = end.detail["result"]
    if rec.get(keys.F_RESULT) is not None:
        out["result"] = unpack(as_bytes(rec[keys.F_RESULT]))
    elif out["state"] == State.DONE.value:
        out.setdefault("result", None)
    if "error" not in out and rec.get(keys.F_ERROR) is not None:  # (a record written before trimming)
        out["error"] = unpack(as_bytes(rec[keys.F_ERROR]))
    if rec.get("data"):
        try:
            out["envelope"] = envelope_of(as_bytes(rec["data"]))
        except Exception:  # noqa: BLE001 - a record with a bad payload is still a record
            out["envelope"] = None
    elif out["state"] in _ENDED:
        out["envelope"] = None
        out["request_dropped"] = True
    return out


_ENDED = frozenset(s.value for s in TERMINAL)


def _int(value: Any) -> int:
    """A counter field as a number; 0 for one that is not (a damaged record is still shown)."""
    try:
        return int(value or 0)
    except ValueError:
        return 0
