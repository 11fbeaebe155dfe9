"""Execution middleware (``llm_execution``, ``tool_execution``): a nested chain around the real call.

The chain is folded once per registration change (first registered is outermost); a call only
creates the per-frame ``next_call`` closures, which must carry per-call single-use state anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from middleware.kinds import PAYLOAD_KEY
from middleware.reporter import callback_label

if TYPE_CHECKING:
    from middleware.reporter import FailureReporter
    from middleware.runtime import Registration

BaseCall = Callable[[Any], Any]


class _Frame:
    """What one call carries down the chain: the base call and the shared payload fields."""

    __slots__ = ("base", "fields")

    def __init__(self, base: BaseCall, fields: dict[str, Any]) -> None:
        self.base = base
        self.fields = fields


class _NextState:
    """Single-use bookkeeping for one middleware frame's ``next_call``."""

    __slots__ = ("called", "reused", "ok", "result", "error")

    def __init__(self) -> None:
        self.called = False
        self.reused = False
        self.ok = False
        self.result: Any = None
        self.error: BaseException | None = None


class _Terminal:
    __slots__ = ()

    def __call__(self, frame: _Frame, payload: Any) -> Any:
        return frame.base(payload)


class _Layer:
    """One registered callback wrapped around everything inside it."""

    __slots__ = ("reg", "inner", "kind", "key", "reporter", "label")

    def __init__(self, reg: Registration, inner: _Layer | _Terminal, kind: str, reporter: FailureReporter):
        self.reg = reg
        self.inner = inner
        self.kind = kind
        self.key = PAYLOAD_KEY[kind]
        self.reporter = reporter
        self.label = callback_label(reg.callback)

    def __call__(self, frame: _Frame, payload: Any) -> Any:
        state = _NextState()
        inner = self.inner

        def next_call(next_payload: Any = None) -> Any:
            if state.called:
                state.reused = True
                # A second call would run the provider or tool twice: refuse instead.
                raise RuntimeError(
                    f"{self.kind} middleware {self.label} called next_call() more than once; "
                    "downstream execution is single-use"
                )
            state.called = True
            try:
                result = inner(frame, payload if next_payload is None else next_payload)
            except BaseException as exc:
                state.error = exc
                raise
            state.ok = True
            state.result = result
            return result

        kwargs = dict(frame.fields)
        kwargs[self.key] = payload
        kwargs["next_call"] = next_call
        try:
            out = self.reg.callback(**kwargs)
        except Exception as exc:
            if state.error is not None:
                if exc is state.error:
                    raise  # the downstream failure propagates unchanged
                if state.reused:
                    raise state.error  # noqa: B904 -- keep its own __cause__; our single-use guard is no translation
                raise  # the middleware translated the downstream failure on purpose
            phase = "after next_call" if state.ok else "before next_call"
            self.reporter.report(
                self.kind, self.reg.callback, exc, kwargs, plugin=self.reg.plugin, phase=phase
            )
            if state.ok:
                return state.result  # keep the downstream result; never run it twice
            return inner(frame, payload)  # fail-open: skip this middleware
        if out is None and state.error is not None:
            # Swallowing a downstream failure into None would report a failed call as a success.
            self.reporter.report(
                self.kind,
                self.reg.callback,
                state.error,
                kwargs,
                plugin=self.reg.plugin,
                phase="swallowed downstream error",
            )
            raise state.error
        return out


class ExecutionChain:
    """The folded chain for one execution kind; callable once per call with a fresh base call."""

    __slots__ = ("kind", "_entry")

    def __init__(self, kind: str, registrations: tuple[Registration, ...], reporter: FailureReporter) -> None:
        self.kind = kind
        entry: _Layer | _Terminal = _Terminal()
        for reg in reversed(registrations):  # fold from the inside out so the first registered is outermost
            entry = _Layer(reg, entry, kind, reporter)
        self._entry = entry

    def __call__(self, payload: Any, base: BaseCall, fields: dict[str, Any]) -> Any:
        """Run ``base(payload)`` through every layer; ``fields`` is the rest of the middleware payload."""
        return self._entry(_Frame(base, fields), payload)
