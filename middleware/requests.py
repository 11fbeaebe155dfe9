"""Request middleware (``llm_request``, ``tool_request``): each may return a full replacement payload."""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from middleware.kinds import PAYLOAD_KEY, middleware_payload, trace_entry
from middleware.logger import get_logger

if TYPE_CHECKING:
    from middleware.reporter import FailureReporter
    from middleware.runtime import Registration

log = get_logger()


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """The effective payload after request middleware, the untouched original, and the trace."""

    payload: Any
    original: Any
    trace: list[dict[str, Any]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when at least one middleware replaced the payload."""
        return bool(self.trace)


def safe_copy(payload: Any) -> Any:
    """Deep-copy a payload; fall back to a shallow copy when it holds something uncopyable (a client)."""
    try:
        return deepcopy(payload)
    except Exception as exc:  # a request may carry sockets or callbacks; sharing them beats failing
        log.debug("deepcopy of middleware payload failed; using a shallow copy", error=str(exc))
        return dict(payload) if isinstance(payload, dict) else payload


def apply_request_chain(
    kind: str,
    registrations: tuple[Registration, ...],
    payload: dict[str, Any],
    fields: dict[str, Any],
    reporter: FailureReporter,
) -> RequestOutcome:
    """Run ``registrations`` in order, each on its own copies of the current and original payload (so
    in-place edits without a returned replacement are ignored and the caller's object is never mutated)."""
    key = PAYLOAD_KEY[kind]
    original = safe_copy(payload)
    current: Any = original
    trace: list[dict[str, Any]] = []
    for reg in registrations:
        kwargs = middleware_payload(
            fields, **{key: safe_copy(current), f"original_{key}": safe_copy(original)}
        )
        try:
            result = reg.callback(**kwargs)
        except Exception as exc:
            reporter.report(kind, reg.callback, exc, kwargs, plugin=reg.plugin)
            continue
        replacement = result.get(key) if isinstance(result, dict) else None
        if not isinstance(replacement, dict):
            if result is not None:  # (None: no change; any other shape is a mistake, said once, then ignored)
                if not isinstance(result, dict):
                    shape = f"a {type(result).__name__}"
                elif key in result:
                    shape = f"{{{key!r}: {type(replacement).__name__}}}"
                else:
                    shape = f"a dict without {key!r}"
                reporter.report(kind, reg.callback, TypeError(
                    f"returned {shape}; expected None (no change) or {{{key!r}: {{...}}}}, the whole new {key}"
                ), kwargs, plugin=reg.plugin, phase="its return")
            continue
        current = replacement
        trace.append(trace_entry(result))
    return RequestOutcome(payload=current, original=original, trace=trace)
