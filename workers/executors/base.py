"""The executor protocol and the context an executor runs in."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker.errors import CallCancelled, ConfigError, ToolTimeout
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
    """Runs one tool call. Must turn back-end failures into typed errors and never kill the process."""

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any: ...

    def close(self) -> None: ...


_instances: dict[str, Executor] = {}
_lock = threading.Lock()


def get_executor(kind: str, settings: dict[str, Any] | None = None) -> Executor:
    """One executor instance per type per process, created on first use from ``workers.executors.<kind>``."""
    inst = _instances.get(kind)
    if inst is not None:
        return inst
    with _lock:
        inst = _instances.get(kind)
        if inst is None:
            try:
                module = importlib.import_module(f"workers.executors.{kind}")
            except ModuleNotFoundError as e:
                raise ConfigError(f"tool executor not found: {kind!r}") from e
            inst = module.create(settings or {})
            _instances[kind] = inst
    return inst


def close_all() -> None:
    with _lock:
        for inst in _instances.values():
            try:
                inst.close()
            except Exception:  # noqa: BLE001 - closing is best effort at shutdown
                pass
        _instances.clear()
