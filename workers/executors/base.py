"""The executor protocol, the context an executor runs in, and helpers of their registration checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from broker.config import ENV_VAR
from broker.errors import CallCancelled, InvalidSpec, ToolTimeout
from broker.toolspec import ToolSpec


@dataclass
class ExecContext:
    """What an executor gets besides the spec and args: deadline, cancellation, progress, trace."""

    call_id: str
    tool_name: str
    timeout: float
    attempt: int = 1
    traceparent: str | None = None
    tracestate: str | None = None
    baggage: str | None = None  # the caller's W3C baggage, forwarded as it came
    cancelled: threading.Event = field(default_factory=threading.Event)
    progress_sink: Callable[[str], None] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    # The back end's own status for the audit record: HTTP status, exit code, gRPC status name (None: none).
    status_code: int | str | None = None

    def trace_headers(self) -> dict[str, str]:
        """W3C ``traceparent``, ``tracestate`` and ``baggage`` for the back end (only those present)."""
        out: dict[str, str] = {}
        if self.traceparent:
            out["traceparent"] = self.traceparent
            if self.tracestate:
                out["tracestate"] = self.tracestate
        if self.baggage:
            out["baggage"] = self.baggage
        return out

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    def remaining(self) -> float:
        """Seconds left before the tool's timeout; raises ToolTimeout when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ToolTimeout(f"tool {self.tool_name!r} timed out after {self.timeout:g}s")
        return left

    def check(self) -> None:
        """Raise if the call was cancelled or ran out of time."""
        if self.cancelled.is_set():
            raise CallCancelled(f"call {self.call_id} was cancelled")
        self.remaining()

    def progress(self, message: str) -> None:
        """Publish a progress message as an event of this call."""
        if self.progress_sink is not None:
            self.progress_sink(message)


class Executor(Protocol):
    """One kind of executor, one module each (``workers/executors/__init__.py`` lists them): its spec keys
    and registration checks on the class, and its run. A run must turn back-end failures into typed errors
    and never kill the process; one instance per process serves every thread."""

    keys: ClassVar[frozenset[str]]  # the spec keys it reads, besides those every spec has

    def __init__(self, settings: dict[str, Any]) -> None: ...

    @staticmethod
    def check(where: str, data: Mapping[str, Any]) -> None:
        """Registration: refuse (InvalidSpec naming the key) a spec of this kind that could never run."""

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any: ...

    def close(self) -> None: ...


def from_env(value: Any) -> bool:
    """True when the text starts with a ``${VAR}`` reference: only the worker's environment can judge it
    (``specenv.py`` fills it in right before the run)."""
    return isinstance(value, str) and ENV_VAR.match(value.strip()) is not None


def require(where: str, kind: str, data: Mapping[str, Any], keys: tuple[str, ...], expected: str) -> None:
    """One of ``keys`` must be given (the error names the first)."""
    if not any(data.get(k) not in (None, "") for k in keys):
        raise InvalidSpec.at(where, keys[0], f"required for a {kind} tool: {expected}")
