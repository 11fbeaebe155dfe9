"""Replaying an audited tool call: the same tool and principal with the recorded arguments; its audit
record names the original (``replay_of``). Redacted arguments must be supplied again: a sensitive one is
checked against its recorded keyed hash, a masked one is taken as given."""

from __future__ import annotations

import contextlib
import json
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from broker.audit import AuditLog, AuditRecord, summarize
from broker.errors import CallCancelled, CallFailed, CallTimeout, ReplayRefused
from broker.logs import MASK, redact_text, verify_hash

# Context a replay carries over: who called matters to policy; the LLM's tool_call_id belongs to the original.
REPLAY_CONTEXT = ("principal", "session_id", "task_id", "turn_id")


@dataclass(frozen=True)
class ReplayPlan:
    """What a replay will run: the tool, its arguments and context, and what was supplied by hand."""

    record: AuditRecord
    tool: str
    args: dict[str, Any]
    context: dict[str, Any]
    verified: tuple[str, ...] = ()  # sensitive args supplied and matching their recorded hash
    unverified: tuple[str, ...] = ()  # masked args supplied with nothing to check them against


@dataclass(frozen=True)
class ReplayOutcome:
    """The recorded call beside its replay."""

    plan: ReplayPlan
    call_id: str
    state: str
    result: Any = None
    error: dict[str, Any] | None = None
    record: AuditRecord | None = None  # the replay's own audit record
    notes: list[str] = field(default_factory=list)


def plan(record: AuditRecord, supplied: Mapping[str, str], digest: Any = None) -> ReplayPlan:
    """Rebuild a call's arguments from its record and the ``supplied`` values (as typed: text); ``digest``:
    ``AuditLog.digest``, what a sensitive one's recorded hash is checked with."""
    if record.kind != "tool" or not record.tool_name:
        raise ReplayRefused(
            f"call {record.call_id} is an {record.kind} call; only tool calls can be replayed "
            "(the audit log keeps an LLM call's parameters, not its conversation)"
        )
    if not isinstance(record.args, dict):
        raise ReplayRefused(f"the audit record of {record.call_id} holds no arguments to replay")
    args = dict(record.args)
    hashed = record.sensitive_hashes
    masked = [k for k, v in args.items() if k not in hashed and _masked(v)]
    extra = sorted(set(supplied) - set(hashed) - set(masked))
    if extra:
        raise ReplayRefused(
            f"--arg {', '.join(extra)}: only redacted arguments may be supplied "
            f"({', '.join(sorted([*hashed, *masked])) or 'none in this call'}); the rest replay as recorded",
            arguments=extra,
        )
    missing = sorted(k for k in [*hashed, *masked] if k not in supplied)
    if missing:
        raise ReplayRefused(
            f"argument(s) {', '.join(missing)} of call {record.call_id} were redacted in the audit log; "
            f"supply them with {' '.join(f'--arg {k}=VALUE' for k in missing)}",
            missing=missing,
        )
    for name, recorded in hashed.items():
        value = _matching(supplied[name], recorded, digest)
        if value is _NO_MATCH:
            raise ReplayRefused(
                f"the value given for {name!r} is not the one call {record.call_id} ran with "
                "(its hash differs from the recorded one)",
                argument=name,
            )
        args[name] = value
    for name in masked:
        args[name] = _parsed(supplied[name])
    context = {k: getattr(record, k) for k in REPLAY_CONTEXT if getattr(record, k, None)}
    context["replay_of"] = record.call_id  # its audit record names the call it replays
    return ReplayPlan(record, record.tool_name, args, context, tuple(sorted(hashed)), tuple(sorted(masked)))


def run(gateway: Any, audit: AuditLog, replay: ReplayPlan, timeout: float | None = None) -> ReplayOutcome:
    """Submit the planned call, wait for it, and fetch its own audit record."""
    handle = gateway.call_tool(replay.tool, replay.args, timeout=timeout, **replay.context)
    ended: tuple[str, Any, dict[str, Any] | None]
    try:
        ended = ("done", handle.result(timeout), None)
    except (CallFailed, CallCancelled, CallTimeout) as e:
        ended = _ended(e)
    return outcome(audit, replay, handle.call_id, *ended)


async def arun(agateway: Any, audit: AuditLog, replay: ReplayPlan, timeout: float | None = None) -> ReplayOutcome:
    """``run`` on an ``AsyncGateway``: the wait holds no thread (the HTTP API's pool serves every route);
    the audit record is read in a thread."""
    import asyncio

    handle = await agateway.call_tool(replay.tool, replay.args, timeout=timeout, **replay.context)
    ended: tuple[str, Any, dict[str, Any] | None]
    try:
        ended = ("done", await handle.result(timeout), None)
    except (CallFailed, CallCancelled, CallTimeout) as e:
        ended = _ended(e)
    return await asyncio.to_thread(outcome, audit, replay, handle.call_id, *ended)


def _ended(e: CallFailed | CallCancelled | CallTimeout) -> tuple[str, Any, dict[str, Any]]:
    """(state, result, error) of a replay that did not end done (``running``: not ended in time)."""
    if isinstance(e, CallTimeout):
        return "running", None, {"type": e.type, "message": str(e)}
    error = {"type": getattr(e, "error_type", None) or e.type, "message": str(e)}
    return ("cancelled" if isinstance(e, CallCancelled) else "failed"), None, error


def outcome(audit: AuditLog, replay: ReplayPlan, call_id: str, state: str, result: Any,
            error: dict[str, Any] | None) -> ReplayOutcome:
    """The replay's outcome, with its own audit record once written."""
    # The record rides in the pipeline of the terminal transition; allow the outbox a moment.
    deadline = time.monotonic() + (2.0 if state != "running" else 0.0)
    while True:
        record = audit.get(call_id)
        if record is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    notes = []
    if replay.verified:
        notes.append(f"sensitive argument(s) {', '.join(replay.verified)} matched their recorded hash")
    if replay.unverified:
        notes.append(f"masked argument(s) {', '.join(replay.unverified)} were taken as given "
                     "(no hash to check)")
    return ReplayOutcome(replay, call_id, state, result, error, record, notes)


def render(outcome: ReplayOutcome, width: int = 110) -> str:
    """The recorded call and its replay side by side."""
    old, new = outcome.plan.record, outcome.record
    new_principal = outcome.plan.context.get("principal")
    done_summary = summarize(outcome.result) if outcome.state == "done" else None
    new_summary = new.result_summary if new is not None else done_summary
    rows = [
        ("call", old.call_id, outcome.call_id),
        ("tool", old.tool_name or "", outcome.plan.tool),
        ("principal", old.principal or "-", (new.principal if new else new_principal) or "-"),
        ("state", old.state, outcome.state),
        ("error", _error(old.error_type, old.error_message), _new_error(outcome)),
        ("result", old.result_summary or "-", new_summary or "-"),
        ("duration", f"{old.duration_ms:.1f} ms", f"{new.duration_ms:.1f} ms" if new else "-"),
    ]
    label, col = 11, max(20, (width - 11 - 3) // 2)
    rule = "-" * (col - 1)
    lines = [f"{'':<{label}}{'recorded':<{col}}   replay", f"{'':<{label}}{rule:<{col}}   {rule}"]
    for name, left, right in rows:
        lcells = textwrap.wrap(str(left), col - 1) or [""]
        rcells = textwrap.wrap(str(right), col - 1) or [""]
        for i, (lc, rc) in enumerate(zip_longest(lcells, rcells, fillvalue="")):
            lines.append(f"{name if i == 0 else '':<{label}}{lc:<{col}}   {rc}".rstrip())
    same = old.state == outcome.state and old.result_summary == new_summary
    lines += ["", "same outcome as recorded" if same else "the outcome differs from the recorded one"]
    lines.extend(f"note: {n}" for n in outcome.notes)
    return "\n".join(lines)


_NO_MATCH = object()


def _masked(value: Any) -> bool:
    if isinstance(value, str):
        return MASK in value
    if isinstance(value, Mapping):
        return any(_masked(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_masked(v) for v in value)
    return False


def _parsed(text: str) -> Any:
    """JSON when the text is a JSON object or array, else the text (the worker coerces it to the schema)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict | list) else text


def _matching(text: str, recorded: str, digest: Any) -> Any:
    """The reading of ``text`` (as text, or as JSON) whose hash is ``recorded``."""
    candidates: list[Any] = [text]
    with contextlib.suppress(ValueError):
        candidates.append(json.loads(text))
    return next((value for value in candidates if verify_hash(value, recorded, digest)), _NO_MATCH)


def _new_error(outcome: ReplayOutcome) -> str:
    if outcome.record is not None:
        return _error(outcome.record.error_type, outcome.record.error_message)
    if not outcome.error:
        return "-"
    return _error(outcome.error.get("type"), redact_text(str(outcome.error.get("message") or "")))


def _error(etype: str | None, message: str | None) -> str:
    if not etype:
        return "-"
    return f"{etype}: {message}" if message else etype
