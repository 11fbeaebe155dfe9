"""The contract's call order, with the worker supplying only the steps that are its own.

Tool call: coerce args → ``tool_request`` → availability → ``pre_tool_call`` (block directive) →
policy (guardrails, approval, schema) on the *effective* args → ``tool_execution`` chain around the
executor → ``post_tool_call`` → ``transform_tool_result``.

LLM call: (worker builds provider kwargs) → ``llm_request`` → ``pre_api_request`` with the
effective request → ``llm_execution`` chain around the provider → ``post_api_request`` or
``api_request_error``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from middleware.execution import BaseCall
from middleware.kinds import (
    API_REQUEST_ERROR,
    LLM_CONTEXT_FIELDS,
    POST_API_REQUEST,
    POST_TOOL_CALL,
    PRE_API_REQUEST,
    PRE_TOOL_CALL,
    TOOL_CONTEXT_FIELDS,
    TRANSFORM_TOOL_RESULT,
    normalize_context,
)
from middleware.llm_hooks import post_api_fields, pre_api_fields, request_view
from middleware.runtime import MiddlewareRuntime

# (tool_name, effective_args, context) -> None, or raise to refuse the call.
Check = Callable[[str, dict[str, Any], dict[str, Any]], Any]
# (effective args or request, run the execution chain) -> its result: the host's step around the chain.
Around = Callable[[dict[str, Any], Callable[[], Any]], Any]


def error_type(exc: BaseException) -> str:
    """The stable type code of a gateway error (its ``type`` attribute), else the class name."""
    code = getattr(exc, "type", None)
    return code if isinstance(code, str) and code else type(exc).__name__


def default_is_cancelled(exc: BaseException) -> bool:
    """Cancellation is a ``cancelled``-typed gateway error or a futures/asyncio cancellation."""
    return (
        isinstance(exc, concurrent.futures.CancelledError | asyncio.CancelledError)
        or error_type(exc) == "cancelled"
    )


def _block_message(results: list[Any]) -> tuple[str, str] | None:
    """The first valid ``{"action": "block"|"approve", "message": ...}`` directive, as Hermes reads it."""
    for result in results:
        if not isinstance(result, dict):
            continue
        action = result.get("action")
        message = result.get("message")
        message = message if isinstance(message, str) else ""
        if action == "approve" or (action == "block" and message):
            return action, message
    return None


def _current(source: Any) -> MiddlewareRuntime:
    """The runtime of a MiddlewareRuntime, MiddlewareRegistry or PluginManager, read per call so a plugin
    reload is picked up by the next call."""
    if isinstance(source, MiddlewareRuntime):
        return source
    runtime = source.runtime
    return runtime() if callable(runtime) else runtime


@dataclass
class ToolCallFlow:
    """Runs one tool call in the contract's order. Build once per worker; ``run()`` per call.

    ``source`` is a MiddlewareRuntime, a MiddlewareRegistry or a PluginManager. Steps (all optional):
    ``coerce(tool_name, args) -> args``; ``check_available`` and ``policy`` as ``Check`` (raise to
    refuse); ``approve(tool_name, message, context) -> bool`` for a pre_tool_call ``approve``
    directive (absent: fail closed, i.e. blocked); ``on_blocked(tool_name, message, context)``
    returns the result of a blocked call or raises (default: ``{"error": message}``, as Hermes).
    """

    source: Any
    coerce: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None
    check_available: Check | None = None
    policy: Check | None = None
    approve: Callable[[str, str, dict[str, Any]], bool] | None = None
    on_blocked: Callable[[str, str, dict[str, Any]], Any] | None = None
    is_cancelled: Callable[[BaseException], bool] = default_is_cancelled

    def run(
        self,
        tool_name: str,
        args: dict[str, Any],
        *,
        execute: BaseCall,
        context: Mapping[str, Any] | None = None,
        check_available: Check | None = None,
        policy: Check | None = None,
        on_trace: Callable[[list[dict[str, Any]]], Any] | None = None,
        skip_plugins: Collection[str] = (),
        around_execution: Around | None = None,
    ) -> Any:
        """Run the call; return the final result or raise. Per-call checks override the flow's.

        ``on_trace(middleware_trace)`` gets the ``tool_request`` trace as soon as it is known, even when a
        later step refuses the call. ``skip_plugins``: keys of plugins the caller already ran.
        ``around_execution(args, chain)`` runs the ``tool_execution`` chain (``chain()``) on the effective
        args, after the checks and before ``post_tool_call``: the host's executing step around it.
        """
        rt = _current(self.source).without(skip_plugins)
        check_available = check_available or self.check_available
        policy = policy or self.policy
        if self.coerce is not None:
            args = self.coerce(tool_name, args)
        ctx = normalize_context(context, TOOL_CONTEXT_FIELDS)
        if rt.empty:
            if check_available is not None:
                check_available(tool_name, args, ctx)
            if policy is not None:
                policy(tool_name, args, ctx)
            return around_execution(args, lambda: execute(args)) if around_execution is not None else execute(args)

        outcome = rt.tool_request(ctx, tool_name, args)
        eff, trace = outcome.payload, outcome.trace
        if on_trace is not None:
            on_trace(list(trace))
        base = {**ctx, "tool_name": tool_name}
        _check(check_available, "error", rt, base, eff, trace, ctx)
        directive = None
        if rt.has_hook(PRE_TOOL_CALL):
            directive = _block_message(rt.emit(PRE_TOOL_CALL, **base, args=eff, middleware_trace=list(trace)))
        if directive is not None:
            action, message = directive
            if action == "approve" and self.approve is not None and self.approve(tool_name, message, ctx):
                directive = None
            elif action == "approve":
                # No gate, or the gate said no: fail closed, as Hermes does.
                reason = f": {message}" if message else ""
                message = f"BLOCKED: plugin approval required for {tool_name}{reason}"
        if directive is not None:
            _post(rt, base, eff, trace, {"error": message}, 0, "blocked", "plugin_block", message)
            if self.on_blocked is not None:
                return self.on_blocked(tool_name, message, ctx)
            return {"error": message}  # (its own dict: not the one the hooks saw)
        _check(policy, "blocked", rt, base, eff, trace, ctx)

        started = time.monotonic()
        try:
            chain = lambda: rt.run_tool_execution(ctx, tool_name, eff, execute, original_args=outcome.original)  # noqa: E731
            result = around_execution(eff, chain) if around_execution is not None else chain()
        except BaseException as exc:
            status = "cancelled" if self.is_cancelled(exc) else "error"
            _post(rt, base, eff, trace, None, _elapsed_ms(started), status, exc=exc)
            raise
        duration_ms = _elapsed_ms(started)
        _post(rt, base, eff, trace, result, duration_ms)
        if rt.has_hook(TRANSFORM_TOOL_RESULT):
            outcome_status, err_type, err_message = result_status(result)
            replaced = rt.emit(  # no middleware_trace: Hermes sends none to this hook
                TRANSFORM_TOOL_RESULT,
                **base,
                args=eff,
                result=result,
                duration_ms=duration_ms,
                status=outcome_status,
                error_type=err_type,
                error_message=err_message,
            )
            # The first replacement wins: a string, as in Hermes, or (our results may be structured) a
            # dict or list; any other return (None, True, 0...) keeps the result.
            result = next((value for value in replaced if isinstance(value, str | dict | list)), result)
        return result


def _check(
    step: Check | None, status: str, rt: MiddlewareRuntime, base: dict[str, Any], eff: dict[str, Any],
    trace: list[dict[str, Any]], ctx: dict[str, Any],
) -> None:
    """Run a refusing step on the effective args; a refusal still reaches post_tool_call (``status``)."""
    if step is not None:
        try:
            step(base["tool_name"], eff, ctx)
        except BaseException as exc:
            _post(rt, base, eff, trace, None, 0, status, exc=exc)
            raise


def _elapsed_ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _post(
    rt: MiddlewareRuntime,
    base: dict[str, Any],
    eff: dict[str, Any],
    trace: list[dict[str, Any]],
    result: Any,
    duration_ms: int,
    status: str = "ok",
    kind: str | None = None,
    message: str | None = None,
    exc: BaseException | None = None,
) -> None:
    """Emit post_tool_call; an ``ok`` call's status comes from its result, as Hermes derives it, a failed
    one's error from ``exc`` (read only when a hook listens)."""
    if rt.has_hook(POST_TOOL_CALL):
        if status == "ok":
            status, kind, message = result_status(result)
        elif exc is not None:
            kind, message = error_type(exc), str(exc)
        rt.emit(
            POST_TOOL_CALL,
            **base,
            args=eff,
            result=result,
            duration_ms=duration_ms,
            status=status,
            error_type=kind,
            error_message=message,
            middleware_trace=list(trace),
        )


def result_status(result: Any) -> tuple[str, str | None, str | None]:
    """(status, error_type, error_message) of a tool result that came back, as Hermes derives them: a
    result (or JSON text) that is an object with a truthy ``error`` is ``("error", "tool_error", ...)``."""
    try:
        parsed = json.loads(result) if isinstance(result, str) else result
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and parsed.get("error"):
        return "error", "tool_error", str(parsed["error"])
    return "ok", None, None


@dataclass
class LLMCallFlow:
    """Runs one provider call in the contract's order. Build once per worker; ``run()`` per attempt.

    ``describe_response(response) -> dict`` may add fields (``usage``, ``finish_reason``...) to
    ``post_api_request``.
    """

    source: Any
    describe_response: Callable[[Any], Mapping[str, Any]] | None = None

    def run(
        self,
        request: dict[str, Any],
        *,
        call_provider: BaseCall,
        context: Mapping[str, Any] | None = None,
        on_trace: Callable[[list[dict[str, Any]]], Any] | None = None,
        retry_count: int | None = None,
        max_retries: int | None = None,
        skip_plugins: Collection[str] = (),
        around_execution: Around | None = None,
    ) -> Any:
        """Run the provider call with ``request`` (the built provider kwargs); return its response or raise.

        ``on_trace`` gets this attempt's ``llm_request`` trace before the provider runs; ``retry_count``
        and ``max_retries`` go to ``api_request_error``; ``skip_plugins`` and ``around_execution`` (around
        the ``llm_execution`` chain, after ``pre_api_request``, before ``post_api_request``) as for tool calls.
        """
        rt = _current(self.source).without(skip_plugins)
        if rt.empty:
            bare = lambda: call_provider(request)  # noqa: E731
            return around_execution(request, bare) if around_execution is not None else bare()
        ctx = normalize_context(context, LLM_CONTEXT_FIELDS)
        outcome = rt.llm_request(ctx, request)
        eff, trace = outcome.payload, outcome.trace
        if isinstance(eff.get("model"), str) and eff["model"] and eff["model"] != ctx["model"]:
            ctx = {**ctx, "model": eff["model"]}  # (a request middleware chose another model: what runs)
        if on_trace is not None:
            on_trace(list(trace))
        started_at = time.time()
        if rt.has_hook(PRE_API_REQUEST):
            rt.emit(
                PRE_API_REQUEST,
                **ctx,
                **pre_api_fields(eff),
                middleware_trace=list(trace),
                started_at=started_at,
            )
        t0 = time.monotonic()
        try:
            chain = lambda: rt.run_llm_execution(  # noqa: E731
                ctx, eff, call_provider, original_request=outcome.original, middleware_trace=trace
            )
            response = around_execution(eff, chain) if around_execution is not None else chain()
        except BaseException as exc:
            if rt.has_hook(API_REQUEST_ERROR):
                rt.emit(
                    API_REQUEST_ERROR,
                    **ctx,
                    **_ended(eff, trace, t0, started_at),
                    status_code=getattr(exc, "status_code", None) or getattr(exc, "status", None),
                    retry_count=retry_count,
                    max_retries=max_retries,
                    retryable=getattr(exc, "retryable", None),
                    reason=error_type(exc),
                    error={"type": error_type(exc), "message": str(exc)},
                )
            raise
        if rt.has_hook(POST_API_REQUEST):
            extra = dict(self.describe_response(response)) if self.describe_response is not None else {}
            fields = post_api_fields(eff, response, extra)
            rt.emit(POST_API_REQUEST, **ctx, **fields, **_ended(eff, trace, t0, started_at))
        return response


def _ended(eff: dict[str, Any], trace: list[dict[str, Any]], t0: float, started_at: float) -> dict[str, Any]:
    """What api_request_error and post_api_request both report (the seed: the effective request reaches
    post_api_request too)."""
    return {
        "request": request_view(eff),
        "middleware_trace": list(trace),
        "api_duration": time.monotonic() - t0,
        "started_at": started_at,
        "ended_at": time.time(),
    }
