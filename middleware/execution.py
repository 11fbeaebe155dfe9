"""Execution middleware (``llm_execution``, ``tool_execution``): a nested chain around the real call.

The chain is folded once per registration change (first registered is outermost); a call only
creates the per-frame ``next_call`` closures, which must carry per-call single-use state anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from middleware.kinds import PAYLOAD_KEY
from middleware.reporter import callback_label
from middleware.requests import safe_copy

if TYPE_CHECKING:
    from middleware.reporter import FailureReporter
    from middleware.runtime import Registration

BaseCall = Callable[[Any], Any]


def _terminal(base: BaseCall, fields: dict[str, Any], payload: Any) -> Any:
    return base(payload)


class _Layer:
    """One registered callback wrapped around everything inside it."""

    __slots__ = ("reg", "inner", "kind", "key", "reporter", "label")

    def __init__(self, reg: Registration, inner: Callable[..., Any], kind: str, reporter: FailureReporter):
        self.reg = reg
        self.inner = inner
        self.kind = kind
        self.key = PAYLOAD_KEY[kind]
        self.reporter = reporter
        self.label = callback_label(reg.callback)

    def __call__(self, base: BaseCall, fields: dict[str, Any], payload: Any) -> Any:
        inner, reg = self.inner, self.reg
        # next_call's single-use bookkeeping for this frame.
        called = reused = ok = False
        result: Any = None
        error: BaseException | None = None

        # Its own copy: should it fail before next_call, what it changed in place goes with it (the contract:
        # a failed middleware is skipped, and the chain goes on with the payload it was given).
        own = safe_copy(payload)

        def next_call(next_payload: Any = None) -> Any:
            nonlocal called, reused, ok, result, error
            if called:
                reused = True
                # A second call would run the provider or tool twice: refuse instead.
                raise RuntimeError(
                    f"{self.kind} middleware {self.label} called next_call() more than once; "
                    "downstream execution is single-use"
                )
            called = True
            try:
                result = inner(base, fields, own if next_payload is None else next_payload)
            except BaseException as exc:
                error = exc
                raise
            ok = True
            return result

        kwargs = {**fields, self.key: own, "next_call": next_call}
        try:
            out = reg.callback(**kwargs)
        except Exception as exc:
            if error is not None:
                if exc is error:
                    raise  # the downstream failure propagates unchanged
                if reused:  # our single-use guard is no translation: the error keeps its own __cause__
                    raise error  # noqa: B904
                raise  # the middleware translated the downstream failure on purpose
            phase = "after next_call" if ok else "before next_call"
            self.reporter.report(self.kind, reg.callback, exc, kwargs, plugin=reg.plugin, phase=phase)
            if ok:
                return result  # keep the downstream result; never run it twice
            return inner(base, fields, payload)  # fail-open: skip this middleware
        if out is None and error is not None:
            # Swallowing a downstream failure into None would report a failed call as a success.
            self.reporter.report(
                self.kind, reg.callback, error, kwargs, plugin=reg.plugin, phase="swallowed downstream error"
            )
            raise error
        return out


class ExecutionChain:
    """The folded chain for one execution kind; callable once per call with a fresh base call."""

    __slots__ = ("kind", "_entry")

    def __init__(self, kind: str, registrations: tuple[Registration, ...], reporter: FailureReporter) -> None:
        self.kind = kind
        entry: Callable[..., Any] = _terminal
        for reg in reversed(registrations):  # fold from the inside out so the first registered is outermost
            entry = _Layer(reg, entry, kind, reporter)
        self._entry = entry

    def __call__(self, payload: Any, base: BaseCall, fields: dict[str, Any]) -> Any:
        """Run ``base(payload)`` through every layer; ``fields`` is the rest of the middleware payload."""
        return self._entry(base, fields, payload)
