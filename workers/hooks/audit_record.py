"""A call's audit record (``broker/audit.py``), appended in the pipeline of its terminal move."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.audit import AuditRecord, context_fields
from workers.hooks import Hook, Writer

if TYPE_CHECKING:
    from workers.runner import Running


class AuditRecordHook(Hook):
    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        env, info = run.env, run.info
        record = AuditRecord.of(
            call_id=info.call_id,
            kind=info.kind,
            state=state,
            args=run.args if run.args is not None else (env.args if env is not None else None),
            sensitive=run.sensitive,
            result=result if state == "done" else None,
            request=env.request if env is not None and env.kind == "llm" else None,
            error=error,
            tool_name=info.name if info.kind == "tool" else None,
            **context_fields(env.context if env is not None else {}),
            trace_id=info.trace_id,
            duration_ms=round(duration * 1000, 3),
            status_code=_status_code(run, error),
            attempts=run.attempt,
            middleware_trace=run.middleware_trace,
            usage=run.usage,
        )
        audit = self.core.audit
        return lambda pipe: audit.append(record, pipeline=pipe)


def _status_code(run: Running, error: dict[str, Any] | None) -> int | str | None:
    """The back end's status for the audit record: what the executor saw, else what its error names."""
    if run.ctx is not None and run.ctx.status_code is not None:
        return run.ctx.status_code
    details = (error or {}).get("details") or {}
    for key in ("status", "exit_code"):
        value = details.get(key) if isinstance(details, dict) else None
        if isinstance(value, int | str) and not isinstance(value, bool):
            return value
    return None
