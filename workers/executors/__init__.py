"""Executors, one module per kind; here what they share: ``ExecContext``, the ``Executor`` protocol,
``run_executor`` (fills a spec's ``${VAR}`` right before the run), ``PerProcess``, ``PerSpec`` and
``EXECUTORS``, the table of kinds, whose classes are imported on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import threading
import time
import zlib
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar
from urllib.parse import quote, quote_plus, unquote, urlsplit

from broker.config import ENV_VAR, expand_env, unset_env
from broker.errors import CallCancelled, ConfigError, ExecutorError, HermesError, InvalidSpec, ToolTimeout
from broker.toolspec import ToolSpec

POLL = 0.05  # seconds between a waiting run's looks at its call's cancellation and deadline
DEFAULT_MAX_OUTPUT = 1024 * 1024  # bytes of a result, unless the spec's max_output says otherwise


class Deadline:
    """The deadline and cancellation a tool run (``ExecContext``) or a provider call checks."""

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
    # The back end's own status for the audit record: HTTP status, exit code, gRPC status name.
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

    def poll_slice(self) -> float:
        """Seconds to wait before looking at cancellation and the deadline again."""
        return max(0.0, min(POLL, self.deadline - time.monotonic()))

    def check_at(self, where: str) -> None:
        """Raise if the call was cancelled or ran out of time (the timeout's message starting ``where``)."""
        if self.cancelled.is_set():
            raise CallCancelled(f"call {self.call_id} was cancelled")
        if time.monotonic() >= self.deadline:
            raise ToolTimeout(f"{where}: timed out after {self.timeout:g}s", timeout=self.timeout)

    def progress(self, message: str) -> None:
        """Publish a progress message as an event of this call."""
        if self.progress_sink is not None:
            self.progress_sink(message)


class Executor(Protocol):
    """One kind of executor. A run raises typed errors only; one instance serves every thread."""

    keys: ClassVar[frozenset[str]]  # the spec keys it reads, besides those every spec has

    def __init__(self, settings: dict[str, Any]) -> None: ...

    @staticmethod
    def check(where: str, data: Mapping[str, Any]) -> None:
        """Registration: refuse (InvalidSpec naming the key) a spec of this kind that could never run."""

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any: ...

    def close(self) -> None: ...


def from_env(value: Any) -> bool:
    """True when the text starts with a ``${VAR}`` reference: only the worker can judge it."""
    return isinstance(value, str) and ENV_VAR.match(value.strip()) is not None


def require(where: str, kind: str, data: Mapping[str, Any], keys: tuple[str, ...], expected: str) -> None:
    """One of ``keys`` must be given (the error names the first)."""
    if not any(data.get(k) not in (None, "") for k in keys):
        raise InvalidSpec.at(where, keys[0], f"required for a {kind} tool: {expected}")


ACCEPT_ENCODING = "gzip, deflate"  # what an HTTP back end may compress with: what Inflater undoes


class Inflater:
    """A response body's ``Content-Encoding`` (none, gzip or deflate) undone piece by piece, no piece past
    ``most`` bytes, so a cap on the decoded body is checked before a small compressed one swells in memory
    (httpx inflates each network read whole: ~1000x for gzip). Any other coding is refused."""

    def __init__(self, coding: str, most: int, where: str) -> None:
        coding = coding.strip().lower()
        if coding not in ("", "identity", "gzip", "x-gzip", "deflate"):
            raise ExecutorError(f"{where}: the response's Content-Encoding {coding!r} was not asked for ({ACCEPT_ENCODING})")
        self.zlib = None if coding in ("", "identity") else zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib
        self.raw_deflate = coding == "deflate"  # (some servers send deflate without its zlib header: tried next)
        self.most, self.where = most, where

    def pieces(self, raw: bytes) -> Iterator[bytes]:
        """The decoded bytes of ``raw`` (with ``b""`` at the end of the body: what the decoder still holds)."""
        if self.zlib is None:
            yield raw
            return
        try:
            if not raw:  # (a match under way: at most 258 bytes)
                yield self.zlib.flush()
            while raw:
                try:
                    piece = self.zlib.decompress(raw, self.most)
                except zlib.error:
                    if not self.raw_deflate:
                        raise
                    self.zlib = zlib.decompressobj(-zlib.MAX_WBITS)
                    piece = self.zlib.decompress(raw, self.most)
                self.raw_deflate = False
                yield piece
                raw = self.zlib.unconsumed_tail
        except zlib.error as e:
            raise ExecutorError(f"{self.where}: the response's compressed body is corrupt: {e}") from e


class Closable(Protocol):
    def close(self) -> None: ...


K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Closable)


class PerProcess(Generic[K, V]):
    """One instance per key per process, made on first use and closed together at shutdown."""

    def __init__(self) -> None:
        self.items: dict[K, V] = {}
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The instance of ``key``, made by ``make()`` the first time (once, under a lock)."""
        if (inst := self.items.get(key)) is not None:
            return inst
        with self._lock:
            if (inst := self.items.get(key)) is None:
                inst = self.items[key] = make()
        return inst

    def forget(self, key: K, inst: V) -> None:
        """Drop ``inst`` (if it is still ``key``'s): the next ``get`` makes a new one."""
        with self._lock:
            if self.items.get(key) is inst:
                del self.items[key]

    def close_all(self) -> None:
        """Close every instance (best effort: at shutdown) and forget them."""
        with self._lock:
            for inst in self.items.values():
                with contextlib.suppress(Exception):  # closing is best effort at shutdown
                    inst.close()
            self.items.clear()


T = TypeVar("T")


class PerSpec(Generic[T]):
    """A value made once per spec object (the directory hands out one per tool version); the object is
    held, so its id is not reused. ``make`` raising caches nothing. Past ``limit`` entries it starts over."""

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


# ``${VAR}`` in ``spec.config`` is filled from the WORKER's environment right before the run (so no secret
# sits in Redis), never in the arguments; the values filled in are shown as their ``${VAR}`` text in the
# executor's errors and progress (results are not touched).

# Shorter values are not scrubbed from messages (a port or "true" is no secret; replacing it would garble).
MIN_SECRET = 6


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A spec with its ``${VAR}`` filled in, and the values that must not be published."""

    spec: ToolSpec
    secrets: tuple[tuple[str, str], ...] = ()  # (value, the ${VAR} text shown instead), longest first

    def scrub(self, text: str) -> str:
        for value, ref in self.secrets:
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

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, str):
            if "${" not in value:
                return value
            if missing := unset_env(value, env):
                raise InvalidSpec(
                    f"{where}: {path}: ${{{missing[0]}}} is not set in the worker's environment",
                    path=path,
                    variable=missing[0],
                )
            for m in ENV_VAR.finditer(value):
                if m.group(1) in env:
                    _note_secret(secrets, env[m.group(1)], f"${{{m.group(1)}}}")
            return expand_env(value, env)
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return value

    config = walk(spec.config, "")
    if config == spec.config:
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


_prepared: PerSpec[Prepared] = PerSpec(expand_spec)


def prepare(spec: ToolSpec) -> Prepared:
    """:func:`expand_spec` from ``os.environ``, cached per spec object (an unset variable is not cached)."""
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
        ctx.progress_sink = lambda message: sink(prepared.scrub(message))
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


def _scrub_error(e: HermesError, prepared: Prepared) -> None:
    message = prepared.scrub(e.message)
    details = prepared.scrub_value(e.details)
    if message == e.message and details == e.details:
        return
    e.message = message
    e.args = (message,)
    e.details = details
    # The chained exception quoted the same text.
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
