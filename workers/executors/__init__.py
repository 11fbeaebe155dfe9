"""Executors, one module per kind: its spec keys and registration checks on its class, and its run.

This module holds what every kind shares: ``ExecContext`` (what a run gets besides the spec and args) and
the ``Executor`` protocol; ``run_executor``, which fills a spec's ``${VAR}`` from the worker's environment
right before the run; ``PerProcess``, one instance per key per process; ``PerSpec``, one value per spec object; and ``EXECUTORS``, the one table
of kinds. A class is imported on first use, so registering a spec loads its
own executor's module only, and none of the libraries its run needs (those are imported in the run).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar
from urllib.parse import quote, quote_plus, unquote, urlsplit

from broker.config import ENV_VAR, expand_env, unset_env
from broker.errors import CallCancelled, ConfigError, ExecutorError, HermesError, InvalidSpec, ToolTimeout
from broker.toolspec import ToolSpec

# -- the context and the protocol -------------------------------------------------------------------


class Deadline:
    """The deadline and cancellation that a tool's run (``ExecContext``) and a provider call
    (``workers.providers.ProviderContext``) both check; each says what running out of time is
    (``timed_out``)."""

    call_id: str
    timeout: float
    started: float
    cancelled: threading.Event

    def timed_out(self) -> HermesError:
        raise NotImplementedError

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    def remaining(self) -> float:
        """Seconds left before the timeout; raises ``timed_out()`` when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timed_out()
        return left

    def check(self) -> None:
        """Raise if the call was cancelled or ran out of time."""
        if self.cancelled.is_set():
            raise CallCancelled(f"call {self.call_id} was cancelled")
        self.remaining()


@dataclass
class ExecContext(Deadline):
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

    def timed_out(self) -> HermesError:
        return ToolTimeout(f"tool {self.tool_name!r} timed out after {self.timeout:g}s")

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
    (``run_executor`` fills it in right before the run)."""
    return isinstance(value, str) and ENV_VAR.match(value.strip()) is not None


def require(where: str, kind: str, data: Mapping[str, Any], keys: tuple[str, ...], expected: str) -> None:
    """One of ``keys`` must be given (the error names the first)."""
    if not any(data.get(k) not in (None, "") for k in keys):
        raise InvalidSpec.at(where, keys[0], f"required for a {kind} tool: {expected}")


# -- one instance per key per process, one value per spec object ------------------------------------
#
# ``PerProcess``: made on first use and closed together at shutdown (executors by kind, LLM providers by
# endpoint). ``PerSpec``: a spec's prepared form (its ``${VAR}`` filled), a tool's breaker config.

class Closable(Protocol):
    def close(self) -> None: ...


K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Closable)


class PerProcess(Generic[K, V]):
    def __init__(self) -> None:
        self.items: dict[K, V] = {}
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The instance of ``key``, made by ``make()`` the first time (once, under a lock)."""
        inst = self.items.get(key)
        if inst is not None:
            return inst
        with self._lock:
            inst = self.items.get(key)
            if inst is None:
                inst = self.items[key] = make()
        return inst

    def close_all(self) -> None:
        """Close every instance (best effort: at shutdown) and forget them."""
        with self._lock:
            for inst in self.items.values():
                try:
                    inst.close()
                except Exception:  # noqa: BLE001 - closing is best effort at shutdown
                    pass
            self.items.clear()


T = TypeVar("T")


class PerSpec(Generic[T]):
    """A value made once per spec object: the directory hands out one object per tool version, so this
    sees each version once (keyed by the object's id; the object is held, so its id is not reused while
    the entry lives). ``make`` raising caches nothing: the next call tries again. Past ``limit`` entries
    (specs of replaced versions) it starts over."""

    def __init__(self, make: Callable[[ToolSpec], T], limit: int = 4096) -> None:
        self._make = make
        self._limit = limit
        self._items: dict[int, tuple[ToolSpec, T]] = {}
        self._lock = threading.Lock()

    def get(self, spec: ToolSpec) -> T:
        hit = self._items.get(id(spec))
        if hit is not None and hit[0] is spec:
            return hit[1]
        value = self._make(spec)
        with self._lock:
            if len(self._items) >= self._limit:
                self._items.clear()
            self._items[id(spec)] = (spec, value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


# -- ${VAR} in a tool spec -------------------------------------------------------------------------
#
# ``${VAR}`` in a tool spec, filled from the WORKER's environment right before its executor runs.
#
# The directory keeps the spec as written (``Authorization: Bearer ${WEATHER_API_TOKEN}``,
# ``dsn: ${WEATHER_DB_DSN}``), so a secret never sits in Redis and ``tool show`` shows the reference.
# Every tool call goes through :func:`run_executor` (``workers/runner.py``), which:
#
# - expands the spec's own configuration (``spec.config``: the executor's keys such as ``endpoint``,
#   ``headers``, ``body_template``, ``dsn``, ``command``, ``env_set``, ``target``; never the name,
#   description or schemas) with the grammar and rules of config.yaml's expander
#   (:func:`broker.config.expand_env`: ``${VAR}`` and ``${VAR:-default}``, no other escapes);
# - does so BEFORE the executor fills ``{{field}}`` placeholders from the arguments, and never on the
#   arguments themselves: an argument value ``"${HOME}"`` reaches the back end as those seven characters;
# - refuses a reference to an unset variable without a ``:-default`` with a typed ``InvalidSpec`` naming
#   the key path and the variable (``tool 'x': headers.Authorization: ${WEATHER_API_TOKEN} is not set
#   in the worker's environment``);
# - caches the result per spec object (the directory hands out the same object until the tool's version
#   changes), so a call of an unchanged spec costs one dict lookup; a spec without ``${`` is used as is;
# - keeps the values it put in out of what the call publishes: in the executor's error messages and
#   details, and in its progress messages, each value (and the password of a URL value) is replaced by
#   the ``${VAR}`` text it came from. Results are the back end's answer and are not touched.
#
# A value taken from the environment is filled in before placeholders are, so it should not itself
# contain ``{{…}}``.

# Values shorter than this are not scrubbed from messages (a port number or "true" is no secret, and
# replacing every "5432" in a message would only garble it).
MIN_SECRET = 6


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A spec with its ``${VAR}`` filled in, and the values that must not be published."""

    spec: ToolSpec
    secrets: tuple[tuple[str, str], ...] = ()  # (value, the ${VAR} text shown instead), longest first

    def scrub(self, text: str) -> str:
        for value, ref in self.secrets:
            if value in text:
                text = text.replace(value, ref)
        return text

    def scrub_value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {k: self.scrub_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub_value(v) for v in value]
        return value


def expand_spec(spec: ToolSpec, environ: Mapping[str, str] | None = None) -> Prepared:
    """``spec`` with ``${VAR}`` in its configuration filled from ``environ`` (default: ``os.environ``)."""
    env = os.environ if environ is None else environ  # user data for ${VAR} in a spec, not a setting
    where = f"tool {spec.name!r}"
    secrets: dict[str, str] = {}
    changed = False

    def walk(value: Any, path: str) -> Any:
        nonlocal changed
        if isinstance(value, str):
            if "${" not in value:
                return value
            missing = unset_env(value, env)
            if missing:
                raise InvalidSpec(
                    f"{where}: {path}: ${{{missing[0]}}} is not set in the worker's environment",
                    path=path,
                    variable=missing[0],
                )
            for m in ENV_VAR.finditer(value):
                if m.group(1) in env:
                    _note_secret(secrets, env[m.group(1)], f"${{{m.group(1)}}}")
            expanded = expand_env(value, env)
            changed = changed or expanded != value
            return expanded
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return value

    config = walk(spec.config, "")
    if not changed:
        return Prepared(spec)
    ordered = tuple(sorted(secrets.items(), key=lambda kv: -len(kv[0])))
    return Prepared(dataclasses.replace(spec, config=config), ordered)


def _note_secret(secrets: dict[str, str], value: str, ref: str) -> None:
    if len(value) >= MIN_SECRET:
        # Also as a URL carries it: a back end quoting the request URL sends it back percent-encoded.
        for form in (value, quote(value, safe=""), quote_plus(value), quote(value)):
            secrets.setdefault(form, ref)
    try:  # a URL's password also travels alone (a driver's error message, a redacted URL)
        password = urlsplit(value).password
    except ValueError:
        password = None
    if password:
        for text in {password, unquote(password)}:
            if len(text) >= MIN_SECRET:
                secrets.setdefault(text, f"<password of {ref}>")


_prepared: PerSpec[Prepared] = PerSpec(lambda spec: expand_spec(spec))


def prepare(spec: ToolSpec) -> Prepared:
    """:func:`expand_spec` from this process's environment, cached per spec object (one per version); an
    unset variable raises and is not cached: the next call says it again."""
    return _prepared.get(spec)


def clear_cache() -> None:
    _prepared.clear()


def run_executor(executor: Executor, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any:
    """Run ``executor`` on ``spec`` with its ``${VAR}`` filled in; what it publishes carries none of them."""
    prepared = prepare(spec)
    if not prepared.secrets:
        return executor.run(prepared.spec, args, ctx)
    sink = ctx.progress_sink
    if sink is not None:
        ctx.progress_sink = _scrubbing(sink, prepared)
    try:
        return executor.run(prepared.spec, args, ctx)
    except HermesError as e:
        _scrub_error(e, prepared)
        raise
    except Exception as e:  # a surprise from a library: its text may quote what we filled in
        text = f"{type(e).__name__}: {e}"
        clean = prepared.scrub(text)
        if clean != text:
            raise ExecutorError(f"tool {spec.name!r}: {clean}") from None
        raise
    finally:
        ctx.progress_sink = sink


def _scrubbing(sink: Callable[[str], None], prepared: Prepared) -> Callable[[str], None]:
    def progress(message: str) -> None:
        sink(prepared.scrub(message))

    return progress


def _scrub_error(e: HermesError, prepared: Prepared) -> None:
    message = prepared.scrub(e.message)
    details = prepared.scrub_value(e.details)
    if message == e.message and details == e.details:
        return
    e.message = message
    e.args = (message,)
    e.details = details
    # The chained exception quoted the same text; nothing prints it, but nothing needs to keep it either.
    e.__cause__ = None
    e.__suppress_context__ = True


EXECUTORS: dict[str, str] = {
    "http": "workers.executors.http:HttpExecutor",
    "command": "workers.executors.command:CommandExecutor",
    "mcp": "workers.executors.mcp:McpExecutor",
    "database": "workers.executors.database:DatabaseExecutor",
    "grpc": "workers.executors.grpc:GrpcExecutor",
    "python": "workers.executors.python:PythonExecutor",
}

_instances: PerProcess[str, Executor] = PerProcess()


def executor_class(kind: str) -> type[Executor]:
    """The class of the executor ``kind`` (ConfigError when there is none)."""
    if kind not in EXECUTORS:
        raise ConfigError(f"tool executor not found: {kind!r}")
    module, _, name = EXECUTORS[kind].partition(":")
    cls: type[Executor] = getattr(importlib.import_module(module), name)
    return cls


def get_executor(kind: str, settings: dict[str, Any] | None = None) -> Executor:
    """One executor instance per kind per process, created on first use."""
    return _instances.get(kind, lambda: executor_class(kind)(settings or {}))


def close_all() -> None:
    _instances.close_all()
