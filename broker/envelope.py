"""The call envelope: everything a worker needs to run one call, versioned and msgpack-encoded."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from .codec import extend_map, pack, unpack
from .errors import DecodeError
from .otel import parse_traceparent, random_hex
from .settings import shortcut_on

T = TypeVar("T")


def filler(cls: type[T]) -> Callable[[Mapping[str, Any]], T]:
    """``make(values)``: an instance of the frozen dataclass ``cls`` holding ``values`` over its defaults,
    made without its ``__init__`` (a frozen ``__init__`` does one ``object.__setattr__`` per field), for the
    few built once per call.
    The caller checks the values (required fields present, no unknown ones) first. With
    ``workers.shortcuts_off: [frozen]`` it calls the class instead."""
    defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}  # type: ignore[arg-type]
    factories = tuple((f.name, f.default_factory) for f in fields(cls) if f.default_factory is not MISSING)  # type: ignore[arg-type]

    def make(values: Mapping[str, Any]) -> T:
        if not shortcut_on("frozen"):
            return cls(**values)
        obj = object.__new__(cls)
        held = obj.__dict__
        held.update(defaults)
        for name, factory in factories:
            if name not in values:
                held[name] = factory()
        held.update(values)
        return obj

    return make


ENVELOPE_VERSION = 1

# ``platform``: the agent's platform (cli, telegram...), passed to LLM middleware as Hermes does;
# ``plugins_applied``: plugin keys the caller already ran around this call (workers skip them);
# ``replay_of``: the call this one replays (``audit replay``), kept in its audit record.
CONTEXT_FIELDS = (
    "session_id", "task_id", "turn_id", "api_request_id", "tool_call_id", "principal", "provider", "model",
    "api_mode", "parent_call_id", "platform", "plugins_applied", "replay_of",
)

KINDS = ("tool", "llm")
# Classes of work (fair dispatch): a person waits on an interactive call; nobody waits on one batch call.
CALL_CLASSES = ("interactive", "batch")


def plugins_applied(context: dict[str, Any]) -> tuple[str, ...]:
    """The plugin keys a call's caller already ran around it (``plugins_applied``, comma-separated)."""
    return tuple(p.strip() for p in str(context.get("plugins_applied") or "").split(",") if p.strip())


_NONE = type(None)
# Types of the optional fields: a wrong type is a malformed payload, caught here rather than deep in a worker.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "tool": (str, _NONE),
    "tool_version": (int,),
    "request": (dict, _NONE),
    "tracestate": (str, _NONE),
    "baggage": (str, _NONE),
    "queue": (str,),
    "channel": (str,),
    "submitted_at": (int, float),
}
_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "timeout": (int, float, _NONE),
    "idempotency_key": (str, _NONE),
    "max_attempts": (int, _NONE),
    "fairness_key": (str, _NONE),
    "call_class": (str, _NONE),
}


def _check_types(data: dict[str, Any], types: dict[str, tuple[type, ...]], where: str) -> None:
    for key, allowed in types.items():
        if key in data:
            value = data[key]
            if type(value) in allowed:  # what msgpack decodes to: exact types, checked at once
                continue
            if isinstance(value, bool) or not isinstance(value, allowed):
                raise DecodeError(f"envelope {where}{key!r} has the wrong type ({type(value).__name__})")


def new_call_id() -> str:
    return random_hex(16)


@dataclass(frozen=True)
class Options:
    """Per-call options."""

    timeout: float | None = None
    idempotency_key: str | None = None
    max_attempts: int | None = None
    # Fair dispatch: whose turn a waiting call takes (default: its principal, else its session) and its
    # class (``interactive`` default, or ``batch``). None = the default.
    fairness_key: str | None = None
    call_class: str | None = None


@dataclass(frozen=True)
class Envelope:
    """One call: a tool call (``tool`` + ``args``) or an LLM call (``request``)."""

    call_id: str
    kind: str
    traceparent: str
    tool: str | None = None
    args: dict[str, Any] | None = None
    tool_version: int = 0
    request: dict[str, Any] | None = None
    context: dict[str, Any] = field(default_factory=dict)
    tracestate: str | None = None
    baggage: str | None = None
    options: Options = field(default_factory=Options)
    queue: str = "tools"
    channel: str = ""
    submitted_at: float = field(default_factory=time.time)
    version: int = ENVELOPE_VERSION

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DecodeError(f"envelope kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "tool" and not self.tool:
            raise DecodeError("a tool call envelope needs a tool name")
        if self.kind == "llm" and not isinstance(self.request, dict):
            raise DecodeError("an llm call envelope needs a request mapping")

    def keep_packed(self, packed: bytes) -> Envelope:
        """Keep the msgpack bytes of the call's body (``args`` or ``request``) the client made when checking
        it, so :meth:`job_data` does not pack it twice; returns ``self``."""
        object.__setattr__(self, "_packed", packed)  # a cache on a frozen dataclass, not a field
        return self

    def job_data(self, func: str) -> bytes:
        """RQ's job ``data``, ``[func, None, [envelope], {}]`` packed; the body's bytes kept by
        :meth:`keep_packed` are put in as they are."""
        out = self.to_dict()
        packed: bytes | None = self.__dict__.get("_packed")
        if packed is None:
            return pack([func, None, [out], {}])
        body = "args" if self.kind == "tool" else "request"
        del out[body]
        # [func, None, [{..., body: <packed>}], {}]: array of 4, nil, array of 1, the map, empty map
        return b"".join((b"\x94", pack(func), b"\xc0\x91", extend_map(pack(out), body), packed, b"\x80"))

    def _trace_ids(self) -> tuple[str, str]:
        """(trace_id, parent span id) of ``traceparent``, parsed once (several readers per call)."""
        ids: tuple[str, str] | None = self.__dict__.get("_ids")
        if ids is None:
            parsed = parse_traceparent(self.traceparent)
            ids = (parsed[0], parsed[1]) if parsed else ("", "")
            object.__setattr__(self, "_ids", ids)  # a cache on a frozen dataclass, not a field
        return ids

    @property
    def trace_id(self) -> str:
        return self._trace_ids()[0]

    @property
    def parent_span_id(self) -> str:
        return self._trace_ids()[1]

    @property
    def name(self) -> str:
        """Tool name or model: what the call runs."""
        if self.kind == "tool":
            return self.tool or ""
        return str((self.request or {}).get("model") or self.context.get("model") or "")

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in _ENVELOPE_FIELDS if name != "options"}
        out["options"] = {name: getattr(self.options, name) for name in _OPTION_FIELDS}
        return out

    def encode(self) -> bytes:
        return pack(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> Envelope:
        if not isinstance(data, dict):
            raise DecodeError(f"envelope must be a mapping, got {type(data).__name__}")
        version = data.get("version")
        if version != ENVELOPE_VERSION:
            raise DecodeError(
                f"unsupported envelope version {version!r} (this worker speaks {ENVELOPE_VERSION})"
            )
        kwargs = {k: v for k, v in data.items() if k in _ENVELOPE_FIELDS}
        opts = kwargs.pop("options", None) or {}
        if not isinstance(opts, dict):
            raise DecodeError("envelope options must be a mapping")
        for key in ("call_id", "kind", "traceparent"):
            if not isinstance(kwargs.get(key), str) or not kwargs.get(key):
                raise DecodeError(f"envelope field {key!r} is missing or not a string")
        if kwargs.get("args") is not None and not isinstance(kwargs["args"], dict):
            raise DecodeError("envelope args must be a mapping")
        context = kwargs.get("context", {})
        if not isinstance(context, dict) or not all(type(v) is str for v in context.values()):
            raise DecodeError("envelope context must be a mapping of text values")  # (as clients send it)
        _check_types(kwargs, _FIELD_TYPES, "field ")
        _check_types(opts, _OPTION_TYPES, "option ")
        # Only known names, each with a default (so no TypeError); checked above, so filled in directly.
        kwargs["options"] = Options(**{k: v for k, v in opts.items() if k in _OPTION_FIELDS})
        env = _fill(kwargs)
        env.__post_init__()
        return env

    @classmethod
    def decode(cls, data: bytes) -> Envelope:
        return cls.from_dict(unpack(data))


# Field names, computed once (dataclasses.fields() is slow).
_ENVELOPE_FIELDS = tuple(f.name for f in fields(Envelope))
_fill = filler(Envelope)
_OPTION_FIELDS = tuple(f.name for f in fields(Options))


def fairness_of(env: Envelope) -> tuple[str, str]:
    """(fairness key, class) of a call: whose turn it takes while waiting for a slot (default: its
    principal, else its session, else the empty key), and ``interactive`` or ``batch``."""
    ctx = env.context
    key = env.options.fairness_key or ctx.get("principal") or ctx.get("session_id") or ""
    return str(key), env.options.call_class or "interactive"


def concurrency_key(env: Envelope) -> str:
    """The key whose limit a call counts against: the tool itself, or the model for LLM calls."""
    return f"tool:{env.tool}" if env.kind == "tool" else f"llm:{env.name}"
