"""The audit record: what the log keeps about one finished call, redacted, with a bounded result preview.

Where records are kept (the capped Redis stream, its index, the JSONL mirror) is ``audit_store``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .codec import pack, unpack
from .errors import DecodeError
from .frozen import filler
from .redact import MASK, is_secret_key, redact, redact_text, sensitive_hashes

AUDIT_VERSION = 1
SUMMARY_LIMIT = 1024  # bytes of UTF-8 in a result summary
# An argument string kept in a record: longer ones keep this much and say how much more there was (the
# whole call is in its job record; scanning megabytes for secrets would stall the worker).
MAX_ARG_TEXT = 64 * 1024
# Request keys that are conversation or tool payload, not model parameters.
_NOT_MODEL_PARAMS = frozenset(
    {"model", "messages", "input", "prompt", "system", "tools", "functions", "contents"}
)


@dataclass(frozen=True)
class AuditRecord:
    """What the audit log keeps about one finished call. Args are stored redacted, never raw."""

    call_id: str
    kind: str  # tool | llm
    state: str  # final state: done | failed | cancelled
    ts: float = field(default_factory=time.time)  # when the call finished, unix seconds
    principal: str | None = None
    tool_name: str | None = None
    model: str | None = None
    model_params: dict[str, Any] = field(default_factory=dict)
    args: Any = None
    result_summary: str | None = None
    duration_ms: float = 0.0
    attempts: int = 1
    error_type: str | None = None
    error_message: str | None = None
    status_code: int | str | None = None  # the back end's: HTTP status, exit code, gRPC status name
    middleware_trace: list[dict[str, Any]] = field(default_factory=list)
    trace_id: str = ""
    api_request_id: str | None = None
    tool_call_id: str | None = None
    session_id: str | None = None
    turn_id: str | None = None
    task_id: str | None = None
    parent_call_id: str | None = None  # the LLM call that asked for this tool call, if known
    replay_of: str | None = None  # the call this one replayed (audit replay), if it is a replay
    sensitive_hashes: dict[str, str] = field(default_factory=dict)
    usage: dict[str, int] | None = None  # an LLM call's tokens: {"in": prompt, "out": completion}
    version: int = AUDIT_VERSION

    @classmethod
    def of(
        cls,
        *,
        call_id: str,
        kind: str,
        state: str,
        args: Mapping[str, Any] | None = None,
        sensitive: tuple[str, ...] | list[str] = (),
        result: Any = None,
        request: Mapping[str, Any] | None = None,
        error: BaseException | Mapping[str, Any] | None = None,
        **rest: Any,
    ) -> AuditRecord:
        """Build a record from raw call data: redacts args, hashes sensitive ones, summarises the result."""
        if request is not None:
            rest.setdefault("model", request.get("model"))
            rest.setdefault("model_params", model_params(request))
        if error is not None:
            etype, emsg = _error_parts(error)
            rest.setdefault("error_type", etype)
            rest.setdefault("error_message", emsg)
        if rest.get("error_message"):
            rest["error_message"] = redact_text(str(rest["error_message"]))
        unknown = set(rest).difference(_RECORD_FIELDS)
        if unknown:
            raise TypeError(f"AuditRecord has no field(s) {', '.join(sorted(unknown))}")
        # Filled in directly rather than through the frozen dataclass's __init__ (one object.__setattr__
        # per field, 25 of them): a worker builds one for every call it finishes.
        return _fill(
            dict(
                call_id=call_id,
                kind=kind,
                state=state,
                args=redact(dict(args), sensitive, max_text=MAX_ARG_TEXT) if args is not None else None,
                sensitive_hashes=sensitive_hashes(args, sensitive),
                result_summary=summarize(result) if result is not None else None,
                middleware_trace=[redact(dict(t)) for t in rest.pop("middleware_trace", None) or ()],
                **rest,
            )
        )

    @property
    def name(self) -> str:
        """Tool name or model: what the call ran."""
        return self.tool_name or self.model or ""

    def to_dict(self) -> dict[str, Any]:
        # Shallow on purpose: the values are already plain data (redacted copies), and asdict's deep copy
        # showed as a tenth of a worker's CPU per call.
        values = self.__dict__
        return {name: values[name] for name in _RECORD_FIELDS}

    def encode(self) -> bytes:
        return pack(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> AuditRecord:
        if not isinstance(data, dict):
            raise DecodeError(f"audit record must be a mapping, got {type(data).__name__}")
        if data.get("version", AUDIT_VERSION) != AUDIT_VERSION:
            raise DecodeError(f"unsupported audit record version {data.get('version')!r}")
        known = {f.name for f in fields(cls)}
        try:
            # Unknown keys are dropped: a newer writer may add fields an older reader does not know.
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise DecodeError(f"audit record does not fit: {e}") from e

    @classmethod
    def decode(cls, data: bytes) -> AuditRecord:
        return cls.from_dict(unpack(data))

    def to_json(self) -> str:
        """One JSONL line (no newline)."""
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"), default=_json_default)


CONTEXT_KEYS = (
    "principal",
    "session_id",
    "turn_id",
    "task_id",
    "api_request_id",
    "tool_call_id",
    "parent_call_id",
    "replay_of",
)


def context_fields(context: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime-context fields an audit record keeps, from a call's context (None where absent)."""
    return {k: context.get(k) for k in CONTEXT_KEYS}


def summarize(result: Any, limit: int = SUMMARY_LIMIT) -> str:
    """A redacted, truncated repr of a result: at most ``limit`` bytes of UTF-8."""
    text = _Preview(limit * 4).render(result)
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    tail = "...(truncated)"
    cut = raw[: limit - len(tail)].decode("utf-8", errors="ignore")  # never split a character
    return cut + tail


class _Full(Exception):
    pass


class _Preview:
    """``repr(redact(value))`` that stops once ``budget`` characters are out: results can be huge."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.parts: list[str] = []
        self.used = 0

    def render(self, value: Any) -> str:
        if isinstance(value, str):  # a text result is shown as text, not as its repr
            return redact_text(value[: self.budget * 4])
        try:
            self._walk(value)
        except _Full:
            self.parts.append("...")
        return "".join(self.parts)

    def _emit(self, text: str) -> None:
        if self.used > self.budget:
            raise _Full
        self.parts.append(text)
        self.used += len(text)

    def _walk(self, value: Any) -> None:
        if isinstance(value, str):
            # Slice with room to spare: a secret cut at the slice end lies far past what is kept.
            self._emit(repr(redact_text(value[: self.budget * 4])))
        elif isinstance(value, Mapping):
            self._emit("{")
            for i, (k, v) in enumerate(value.items()):
                self._emit(f"{', ' if i else ''}{k!r}: ")
                if isinstance(k, str) and is_secret_key(k) and v not in (None, ""):
                    self._emit(repr(MASK))
                else:
                    self._walk(v)
            self._emit("}")
        elif value is None or type(value) in (int, float, bool):  # no secret has the shape of a number
            self._emit(repr(value))
        elif isinstance(value, list | tuple):
            self._emit("[" if isinstance(value, list) else "(")
            for i, v in enumerate(value):
                self._emit(", " if i else "")
                self._walk(v)
            self._emit("]" if isinstance(value, list) else ")")
        else:
            self._emit(redact_text(repr(redact(value)))[: self.budget * 4])


def model_params(request: Mapping[str, Any]) -> dict[str, Any]:
    """The model parameters of an LLM request (temperature, max_tokens, ...), without the conversation."""
    return redact({k: v for k, v in request.items() if k not in _NOT_MODEL_PARAMS})


def _error_parts(error: BaseException | Mapping[str, Any]) -> tuple[str, str]:
    if isinstance(error, Mapping):
        return str(error.get("type") or "error"), str(error.get("message") or "")
    return str(getattr(error, "type", None) or type(error).__name__), str(error)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes | bytearray):
        return bytes(obj).decode("utf-8", errors="replace")
    if isinstance(obj, set | frozenset | tuple):
        return list(obj)
    return str(obj)


# XADD, trim by count and/or age, index the call id, and trim the index to the stream's first entry.
# One script so the index and the stream cannot drift apart. KEYS: stream, index.
# ARGV: maxlen (0 = none), minid (0 = none), "~" or "=", call_id ("" = trim only), field, value, ...


_RECORD_FIELDS = tuple(f.name for f in fields(AuditRecord))
_fill = filler(AuditRecord)
