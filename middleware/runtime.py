"""``MiddlewareRegistry`` (what plugins registered) and ``MiddlewareRuntime``, its immutable snapshot."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from middleware.execution import BaseCall, ExecutionChain
from middleware.kinds import (
    KINDS,
    LLM_CONTEXT_FIELDS,
    LLM_EXECUTION,
    LLM_REQUEST,
    TELEMETRY_SCHEMA_VERSION,
    TOOL_CONTEXT_FIELDS,
    TOOL_EXECUTION,
    TOOL_REQUEST,
    VALID_HOOKS,
    middleware_payload,
    normalize_context,
)
from middleware.logger import get_logger
from middleware.reporter import FailureReporter, callback_label
from middleware.requests import RequestOutcome, apply_request_chain, safe_copy

if TYPE_CHECKING:
    from middleware.context import PluginContext

log = get_logger()


@dataclass(frozen=True, slots=True)
class Registration:
    """One registered callback and the plugin that registered it (None when registered directly)."""

    name: str
    callback: Callable[..., Any]
    plugin: str | None = None


class MiddlewareRegistry:
    """Registered middleware and hooks; ``runtime()`` returns the snapshot calls run through.

    Registration takes a lock; calls read the snapshot (with its folded execution chains) lock-free.
    It is rebuilt only after a registration change.
    """

    def __init__(self, reporter: FailureReporter | None = None) -> None:
        self.reporter = reporter or FailureReporter()
        self._lock = threading.Lock()
        self._middleware: dict[str, list[Registration]] = {kind: [] for kind in KINDS}
        self._hooks: dict[str, list[Registration]] = {}
        self._runtime: MiddlewareRuntime | None = None

    def register_middleware(self, kind: str, callback: Callable[..., Any], plugin: str | None = None) -> bool:
        """Add ``callback`` for ``kind``; an unknown kind is warned about (naming the valid ones) and ignored."""
        if kind not in self._middleware:
            log.warning(
                f"plugin {plugin or '<direct>'} registered unknown middleware kind {kind!r}; "
                f"valid kinds: {', '.join(KINDS)}; ignored",
                plugin=plugin,
                kind=kind,
                valid=list(KINDS),
            )
            return False
        self._add(self._middleware, kind, callback, plugin, f"middleware for {kind!r}")
        log.debug("middleware registered", kind=kind, plugin=plugin, callback=callback_label(callback))
        return True

    def register_hook(self, name: str, callback: Callable[..., Any], plugin: str | None = None) -> None:
        """Add an observer hook; unknown names are warned about but kept, as Hermes does."""
        if name not in VALID_HOOKS:
            log.warning(
                f"plugin {plugin or '<direct>'} registered unknown hook {name!r}; "
                f"valid hooks: {', '.join(sorted(VALID_HOOKS))}",
                plugin=plugin,
                hook=name,
            )
        self._add(self._hooks, name, callback, plugin, f"hook {name!r}")

    def _add(
        self, table: dict[str, list[Registration]], name: str, callback: Any, plugin: str | None, what: str
    ) -> None:
        if not callable(callback):
            raise TypeError(f"{what} must be callable, got {type(callback).__name__}")
        with self._lock:
            table.setdefault(name, []).append(Registration(name, callback, plugin))
            self._runtime = None  # the next runtime() folds a fresh snapshot

    def context(self, plugin: str, manifest: Any = None) -> PluginContext:
        """The ``ctx`` handed to a plugin's ``register(ctx)``."""
        from middleware.context import PluginContext

        return PluginContext(self, plugin, manifest)

    def runtime(self) -> MiddlewareRuntime:
        """The current immutable snapshot; cheap when nothing changed since the last call."""
        snapshot = self._runtime
        if snapshot is not None:
            return snapshot
        with self._lock:
            if self._runtime is None:
                self._runtime = MiddlewareRuntime(
                    {kind: tuple(regs) for kind, regs in self._middleware.items()},
                    {name: tuple(regs) for name, regs in self._hooks.items()},
                    self.reporter,
                )
            return self._runtime


class MiddlewareRuntime:
    """Runs request middleware, execution chains and observer hooks; safe to share across threads.

    ``empty``: nothing is registered, so the caller may run the base call directly.
    """

    __slots__ = ("_middleware", "_hooks", "_chains", "reporter", "empty", "_without")

    def __init__(
        self,
        middleware: Mapping[str, tuple[Registration, ...]],
        hooks: Mapping[str, tuple[Registration, ...]],
        reporter: FailureReporter,
    ) -> None:
        self._middleware = dict(middleware)
        self._hooks = {name: regs for name, regs in hooks.items() if regs}  # has_hook: a key is a callback
        self.reporter = reporter
        self._chains = {
            kind: ExecutionChain(kind, self._middleware[kind], reporter)
            for kind in (LLM_EXECUTION, TOOL_EXECUTION)
            if self._middleware.get(kind)
        }
        self.empty = not any(self._middleware.values()) and not self._hooks
        self._without: dict[frozenset[str], MiddlewareRuntime] = {}

    def without(self, plugins: Collection[str]) -> MiddlewareRuntime:
        """This runtime minus every callback the given plugins (keys) registered; cached per set.

        For a call whose caller (a Hermes agent sharing our HERMES_HOME) already ran those plugins.
        """
        skip = frozenset(p for p in plugins if p)
        if not skip or self.empty:
            return self
        found = self._without.get(skip)
        if found is None:
            found = MiddlewareRuntime(
                {k: tuple(r for r in regs if r.plugin not in skip) for k, regs in self._middleware.items()},
                {k: tuple(r for r in regs if r.plugin not in skip) for k, regs in self._hooks.items()},
                self.reporter,
            )
            if len(self._without) < 64:  # a handful of distinct sets in practice; never unbounded
                self._without[skip] = found
        return found

    def middleware(self, kind: str) -> tuple[Registration, ...]:
        """The registrations for ``kind`` in registration (= chain) order."""
        return tuple(self._middleware.get(kind, ()))

    def has_middleware(self, kind: str) -> bool:
        """True when at least one callback is registered for ``kind``."""
        return bool(self._middleware.get(kind))

    def has_hook(self, name: str) -> bool:
        """True when at least one callback is registered for hook ``name``."""
        return name in self._hooks

    def tool_request(
        self, context: Mapping[str, Any] | None, tool_name: str, args: dict[str, Any]
    ) -> RequestOutcome:
        """Apply ``tool_request`` middleware; the outcome holds effective args, original args and trace."""
        regs = self._middleware.get(TOOL_REQUEST)
        if not regs:
            return RequestOutcome(payload=args, original=args, trace=[])
        fields = normalize_context(context, TOOL_CONTEXT_FIELDS)
        fields["tool_name"] = tool_name
        return apply_request_chain(TOOL_REQUEST, regs, args, fields, self.reporter)

    def llm_request(self, context: Mapping[str, Any] | None, request: dict[str, Any]) -> RequestOutcome:
        """Apply ``llm_request`` middleware; the outcome holds effective request, original and trace."""
        regs = self._middleware.get(LLM_REQUEST)
        if not regs:
            return RequestOutcome(payload=request, original=request, trace=[])
        fields = normalize_context(context, LLM_CONTEXT_FIELDS)
        return apply_request_chain(LLM_REQUEST, regs, request, fields, self.reporter)

    def apply_tool_request(
        self, context: Mapping[str, Any] | None, tool_name: str, args: dict[str, Any]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Return ``(effective_args, middleware_trace)``; the caller's ``args`` is never mutated."""
        outcome = self.tool_request(context, tool_name, args)
        return outcome.payload, outcome.trace

    def apply_llm_request(
        self, context: Mapping[str, Any] | None, request: dict[str, Any]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Return ``(effective_request, middleware_trace)``; the caller's ``request`` is never mutated."""
        outcome = self.llm_request(context, request)
        return outcome.payload, outcome.trace

    def run_tool_execution(
        self,
        context: Mapping[str, Any] | None,
        tool_name: str,
        args: dict[str, Any],
        base: BaseCall,
        *,
        original_args: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``base(args)`` through the ``tool_execution`` chain; returns the tool's own result shape."""
        chain = self._chains.get(TOOL_EXECUTION)
        if chain is None:
            return base(args)
        fields = normalize_context(context, TOOL_CONTEXT_FIELDS)
        fields["tool_name"] = tool_name
        # (No middleware_trace here: Hermes sends none to tool_execution.)
        if original_args is None or original_args is args:  # (no tool_request replaced them)
            original_args, args = args, safe_copy(args)  # an in-place edit of args leaves the original as it was
        payload = middleware_payload(fields, original_args=original_args)
        return chain(args, base, payload)

    def run_llm_execution(
        self,
        context: Mapping[str, Any] | None,
        request: dict[str, Any],
        base: BaseCall,
        *,
        original_request: dict[str, Any] | None = None,
        middleware_trace: list[dict[str, Any]] | None = None,
    ) -> Any:
        """Run ``base(request)`` through the ``llm_execution`` chain; returns the provider's own response."""
        chain = self._chains.get(LLM_EXECUTION)
        if chain is None:
            return base(request)
        fields = normalize_context(context, LLM_CONTEXT_FIELDS)
        if original_request is None or original_request is request:  # (no llm_request replaced it)
            original_request, request = request, safe_copy(request)
        payload = middleware_payload(
            fields,
            original_request=original_request,
            middleware_trace=list(middleware_trace or ()),
        )
        return chain(request, base, payload)

    def emit(self, hook_name: str, **payload: Any) -> list[Any]:
        """Call every callback of ``hook_name``; failures are logged (warn-once) and skipped.

        Returns the non-None return values in registration order. Each callback gets its own copies
        of the payload's values, so writing to them changes neither the call nor a later hook.
        """
        regs = self._hooks.get(hook_name)
        if not regs:
            return []
        payload.setdefault("telemetry_schema_version", TELEMETRY_SCHEMA_VERSION)
        results: list[Any] = []
        for reg in regs:
            try:
                ret = reg.callback(**{k: safe_copy(v) for k, v in payload.items()})
            except Exception as exc:
                self.reporter.report(f"hook {hook_name}", reg.callback, exc, payload, plugin=reg.plugin)
                continue
            if ret is not None:
                results.append(ret)
        return results

    def run_tool_call(
        self,
        tool_name: str,
        args: dict[str, Any],
        *,
        execute: BaseCall,
        context: Mapping[str, Any] | None = None,
        **steps: Any,
    ) -> Any:
        """One tool call in the contract's order; ``steps`` are ToolCallFlow's optional callables."""
        from middleware.call_order import ToolCallFlow

        return ToolCallFlow(self, **steps).run(tool_name, args, execute=execute, context=context)

    def run_llm_call(
        self,
        request: dict[str, Any],
        *,
        call_provider: BaseCall,
        context: Mapping[str, Any] | None = None,
        **steps: Any,
    ) -> Any:
        """One provider call in the contract's order; ``steps`` are LLMCallFlow's optional callables."""
        from middleware.call_order import LLMCallFlow

        return LLMCallFlow(self, **steps).run(request, call_provider=call_provider, context=context)
