"""The ``python`` executor: call ``package.module:callable`` (sync or async) in the worker.

A callable with a ``ctx`` parameter (or listed in ``executors.python.inline``) runs on the call's own
thread (with ``ctx``, it can watch the deadline and cancellation itself). Any other runs on a helper
thread (``pyhelpers``): at the deadline or on cancellation the call ends at once and the function is
abandoned and stopped with :class:`ToolStopped`; past ``max_abandoned`` of them still running, new calls
of that tool fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from broker.errors import ExecutorError, HermesError, InvalidArgs, InvalidSpec
from broker.toolspec import ToolSpec

from . import ExecContext, from_env, require
from .pyhelpers import DEFAULT_MAX_ABANDONED, FINISHED, HelperPool, Job, Tally, ToolStopped

log = structlog.get_logger("hermes.executor.python")
_DOTTED = re.compile(r"[^\W\d]\w*(?:\.[^\W\d]\w*)*")


def split_ref(ref: str) -> tuple[str, str] | None:
    """``module:attr`` (or ``module.attr``) as (module, attr), or None when it is not that shape."""
    module, sep, attr = ref.strip().partition(":")
    if not sep:
        module, _, attr = ref.strip().rpartition(".")
    return (module, attr) if _DOTTED.fullmatch(module) and _DOTTED.fullmatch(attr) else None


class _Target:
    """A resolved callable and what we learned about it once."""

    def __init__(self, fn: Callable[..., Any], inline: bool) -> None:
        self.fn = fn
        try:
            self.signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None
        self.wants_ctx = self.signature is not None and "ctx" in self.signature.parameters
        self.inline = self.wants_ctx or inline  # on the call's own thread (else on a helper thread)
        # A plain signature (named parameters, maybe ``**kwargs``) is checked against these sets, not bound.
        self.names: frozenset[str] | None = None
        self.any_name = False  # it takes ``**kwargs``: any name fits
        self.required: frozenset[str] = frozenset()
        if self.signature is not None:
            params = self.signature.parameters.values()
            kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)
            if all(p.kind in kinds for p in params):
                named = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
                self.names = frozenset(p.name for p in named)
                self.any_name = len(named) < len(params)
                self.required = frozenset(p.name for p in named if p.default is inspect.Parameter.empty)

    def fits(self, kwargs: dict[str, Any]) -> bool:
        """True when ``kwargs`` certainly bind (False: bind the signature for the exact error)."""
        if self.names is None:
            return False
        return (self.any_name or self.names.issuperset(kwargs)) and self.required.issubset(kwargs)


class PythonExecutor:
    """Calls Python functions in-process; thread-safe (the resolved-callable cache is locked)."""

    keys = frozenset({"function", "max_output"})

    @staticmethod
    def check(where: str, data: Mapping[str, Any]) -> None:
        require(where, "python", data, ("function",), '"package.module:callable"')
        ref = data["function"]
        if not from_env(ref) and (not isinstance(ref, str) or split_ref(ref) is None):
            raise InvalidSpec.at(where, "function", f"expected 'package.module:callable', got {ref!r}")

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self._targets: dict[str, _Target] = {}
        self._lock = threading.Lock()
        self._helpers = HelperPool()
        self._tallies: dict[str, Tally] = {}
        self._max_abandoned = int(settings.get("max_abandoned", DEFAULT_MAX_ABANDONED))
        self._inline = frozenset(str(ref).replace(":", ".") for ref in settings.get("inline") or ())
        for path in settings.get("paths") or ():
            if str(path) not in sys.path:
                sys.path.append(str(path))

    def resolve(self, ref: Any, where: str) -> _Target:
        """Import ``module:attr`` once (``module.attr`` also accepted); a bad reference is a spec error."""
        target = self._targets.get(ref) if isinstance(ref, str) else None
        if target is not None:
            return target
        split = split_ref(ref) if isinstance(ref, str) else None
        if split is None:
            raise InvalidSpec.at(where, "function", f"expected 'package.module:callable', got {ref!r}")
        module_name, attr = split
        with self._lock:
            try:
                obj: Any = importlib.import_module(module_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except ImportError as e:
                raise InvalidSpec.at(where, "function", f"cannot import {module_name!r}: {e}") from e
            except AttributeError as e:
                raise InvalidSpec.at(where, "function", f"{module_name!r} has no {attr!r}") from e
            if not callable(obj):
                raise InvalidSpec.at(where, "function", f"{ref!r} is not callable")
            target = self._targets[ref] = _Target(obj, ref.replace(":", ".") in self._inline)
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
            if target.inline:
                result = _call(target.fn, kwargs, ctx, where)
            else:
                result = self._run_on_helper(spec, target.fn, kwargs, ctx, where)
        except (HermesError, ToolStopped):
            raise
        except BaseException as e:  # noqa: BLE001 - any failure of user code is a failed call, not a dead worker
            # (SystemExit too: sys.exit() or argparse's error on a hostile argument; it escaped the call
            # thread, the call hung and a lease later ran again)
            raise ExecutorError(f"{type(e).__name__}: {_text_of(e)}", exception=type(e).__name__) from e
        ctx.check_at(where)
        try:
            return to_wire_value(result, where)
        except RecursionError:  # (a result that holds itself, or nested thousands deep)
            raise ExecutorError(f"{where}: result is nested too deeply to send (or contains itself)") from None

    def _run_on_helper(
        self, spec: ToolSpec, fn: Callable[..., Any], kwargs: dict[str, Any], ctx: ExecContext, where: str
    ) -> Any:
        """Run ``fn`` on a helper thread; give up on it at the deadline or on cancellation."""
        if (tally := self._tallies.get(spec.name)) is None:
            with self._lock:
                tally = self._tallies.setdefault(spec.name, Tally())
        limit = self._max_abandoned
        if tally.count >= limit:
            raise ExecutorError(
                f"{where}: {tally.count} earlier calls of this tool timed out or were cancelled and are still "
                f"running in this worker (max_abandoned {limit}); new calls fail until they end "
                "(a python tool that takes a ctx parameter can stop on its own)",
                abandoned=tally.count,
            )
        job = Job(lambda: _call(fn, kwargs, ctx, where, job.cooperate), tally)
        self._helpers.submit(job)
        while not job.done.acquire(timeout=ctx.poll_slice()):
            if ctx.cancelled.is_set() or time.monotonic() >= ctx.deadline:
                job.stop()
                if job.state != FINISHED:
                    log.warning(
                        "python tool abandoned; asked to stop",
                        reason="cancelled" if ctx.cancelled.is_set() else "timed out",
                        function=spec.config.get("function"),
                        still_running=tally.count,
                    )
                ctx.check_at(where)
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        self._targets.clear()
        self._helpers.close()


def _text_of(error: BaseException) -> str:
    """``str(error)``, or its type's name when that raises (user code's ``__str__``)."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001
        return f"<{type(error).__name__} whose message cannot be read>"


def _call(fn: Callable[..., Any], kwargs: dict[str, Any], ctx: ExecContext, where: str,
          cooperate: Callable[[], None] | None = None) -> Any:
    """``fn(**kwargs)``; an async function's coroutine is run to its end here (``cooperate``: told first,
    its loop stops it)."""
    result = fn(**kwargs)
    if not inspect.isawaitable(result):
        return result
    if cooperate is not None:
        cooperate()
    return _run_async(result, ctx, where)


def _run_async(awaitable: Any, ctx: ExecContext, where: str) -> Any:
    """Run a coroutine on a fresh loop in this thread, cancelling it at the deadline or on cancel."""

    async def guarded() -> Any:
        task = asyncio.ensure_future(awaitable)
        while True:
            done, _ = await asyncio.wait({task}, timeout=ctx.poll_slice())
            if done:
                return task.result()
            if ctx.cancelled.is_set() or time.monotonic() >= ctx.deadline:
                task.cancel()
                with contextlib.suppress(BaseException):  # the task's own outcome no longer matters
                    await task
                ctx.check_at(where)

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

