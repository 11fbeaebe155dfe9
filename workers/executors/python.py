"""The ``python`` executor: call ``package.module:callable`` in the worker with the arguments.

Spec keys: ``function: "package.module:callable"`` (sync or async). The callable gets ``**args``; one
with a parameter named ``ctx`` also gets the :class:`ExecContext` (deadline, cancellation, progress).
Settings ``executors.python.paths`` lists extra directories to put on ``sys.path``.

Async callables run on a private event loop in the worker thread and are cancelled at the deadline or
on cancellation. Sync callables cannot be interrupted from outside: they should watch
``ctx.cancelled``; a result that arrives after cancellation or the deadline is discarded.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from broker.errors import (
    CallCancelled,
    ExecutorError,
    HermesError,
    InvalidArgs,
    InvalidSpec,
    ToolTimeout,
)
from broker.toolspec import ToolSpec

from .base import ExecContext

_POLL = 0.05


class _Target:
    """A resolved callable and what we learned about it once."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        try:
            self.signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None
        self.wants_ctx = self.signature is not None and "ctx" in self.signature.parameters
        # For a plain signature (named parameters only), arguments are checked against these sets
        # instead of binding the signature on every call; anything else is bound as before.
        self.names: frozenset[str] | None = None
        self.required: frozenset[str] = frozenset()
        if self.signature is not None:
            params = self.signature.parameters.values()
            plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            if all(p.kind in plain for p in params):
                self.names = frozenset(p.name for p in params)
                self.required = frozenset(p.name for p in params if p.default is inspect.Parameter.empty)
        # Instances with an ``async def __call__`` count as async too.
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)

    def fits(self, kwargs: dict[str, Any]) -> bool:
        """True when ``kwargs`` certainly bind (False: bind the signature for the exact error)."""
        return self.names is not None and self.names.issuperset(kwargs) and self.required.issubset(kwargs)


class PythonExecutor:
    """Calls Python functions in-process; thread-safe (the resolved-callable cache is locked)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self._targets: dict[str, _Target] = {}
        self._lock = threading.Lock()
        for path in settings.get("paths") or ():
            if str(path) not in sys.path:
                sys.path.append(str(path))

    def resolve(self, ref: Any, where: str) -> _Target:
        """Import ``module:attr`` once (``module.attr`` also accepted); a bad reference is a spec error."""
        target = self._targets.get(ref) if isinstance(ref, str) else None
        if target is not None:
            return target
        if not isinstance(ref, str) or not ref.strip():
            raise InvalidSpec(f"{where}: function: expected 'package.module:callable', got {ref!r}")
        module_name, sep, attr = ref.partition(":")
        if not sep:
            module_name, _, attr = ref.rpartition(".")
        if not module_name or not attr:
            raise InvalidSpec(f"{where}: function: expected 'package.module:callable', got {ref!r}")
        with self._lock:
            try:
                obj: Any = importlib.import_module(module_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except ImportError as e:
                raise InvalidSpec(f"{where}: function: cannot import {module_name!r}: {e}") from e
            except AttributeError as e:
                raise InvalidSpec(f"{where}: function: {module_name!r} has no {attr!r}") from e
            if not callable(obj):
                raise InvalidSpec(f"{where}: function: {ref!r} is not callable")
            target = _Target(obj)
            self._targets[ref] = target
        return target

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any:
        where = f"tool {spec.name!r}"
        target = self.resolve(spec.config.get("function"), where)
        kwargs = dict(args)
        if target.wants_ctx:
            if "ctx" in kwargs:
                raise InvalidArgs(f"{where}: 'ctx' is reserved and cannot be passed as an argument")
            kwargs["ctx"] = ctx
        if target.signature is not None and not target.fits(kwargs):
            try:
                target.signature.bind(**kwargs)
            except TypeError as e:
                raise InvalidArgs(f"{where}: {e}", violations=[str(e)]) from e
        ctx.check()
        try:
            if target.is_async:
                result = _run_async(target.fn(**kwargs), ctx, where)
            else:
                result = target.fn(**kwargs)
                if inspect.isawaitable(result):
                    result = _run_async(result, ctx, where)
        except HermesError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of user code is a failed call, not a dead worker
            raise ExecutorError(f"{type(e).__name__}: {e}", exception=type(e).__name__) from e
        if ctx.cancelled.is_set():
            raise CallCancelled(f"call {ctx.call_id} was cancelled")
        if time.monotonic() >= ctx.deadline:
            raise ToolTimeout(f"{where}: timed out after {ctx.timeout:g}s", timeout=ctx.timeout)
        return to_wire_value(result, where)

    def close(self) -> None:
        self._targets.clear()


def _run_async(awaitable: Any, ctx: ExecContext, where: str) -> Any:
    """Run a coroutine on a fresh loop in this thread, cancelling it at the deadline or on cancel."""

    async def guarded() -> Any:
        task = asyncio.ensure_future(awaitable)
        while True:
            left = ctx.deadline - time.monotonic()
            done, _ = await asyncio.wait({task}, timeout=max(0.0, min(_POLL, left)))
            if done:
                return task.result()
            if ctx.cancelled.is_set() or time.monotonic() >= ctx.deadline:
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001 - the task's own outcome no longer matters
                    pass
                if ctx.cancelled.is_set():
                    raise CallCancelled(f"call {ctx.call_id} was cancelled")
                raise ToolTimeout(f"{where}: timed out after {ctx.timeout:g}s", timeout=ctx.timeout)

    return asyncio.run(guarded())


def to_wire_value(value: Any, where: str, path: str = "$") -> Any:
    """Check (and lightly normalise) a result so it can travel as msgpack: plain data only."""
    if value is None or isinstance(value, str | bool | int | float | bytes):
        return value
    if isinstance(value, list | tuple):
        return [to_wire_value(v, where, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise ExecutorError(f"{where}: result key at {path} is a {type(k).__name__}, not a string")
            out[k] = to_wire_value(v, where, f"{path}.{k}")
        return out
    raise ExecutorError(
        f"{where}: result at {path} is a {type(value).__name__}; return dict/list/str/int/float/bool/None/bytes"
    )


def create(settings: dict[str, Any]) -> PythonExecutor:
    return PythonExecutor(settings)
