"""A tool call's phase spans under ``process <queue>``: ``tool_request`` (request middleware, when any),
``policy`` (the checks), ``tool_execution`` (the execution chain, when any) and ``execute_tool <tool>``
around the executor (``workers/telemetry.py``; every method does nothing when tracing is off)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.hooks.hook import Hook

if TYPE_CHECKING:
    from broker.toolspec import ToolSpec
    from workers.runner import Running


class CallSpans(Hook):
    def _registered(self, run: Running, stage: str) -> bool:
        return run.trace.span is not None and self.core.plugins.runtime.has_middleware(stage)

    def before_flow(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        if self._registered(run, "tool_request"):
            run.trace.open("tool_request")

    def before_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        run.trace.close("tool_request")
        run.trace.open("policy")

    def after_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        run.trace.close("policy", error)
        if error is None and self._registered(run, "tool_execution"):
            run.trace.open("tool_execution")

    def before_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        # The executors forward ctx.traceparent: the executor span's context, so the back end's parent is it.
        run.span = run.trace.executor(spec, args, run.ctx, spec.sensitive)
        run.span.__enter__()

    def after_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        span, run.span = run.span, None
        if span is not None:
            span.__exit__(type(error) if error is not None else None, error, None)

    def after_flow(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        run.trace.close("tool_execution")

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None:
        run.trace.end(outcome, error)
