"""The audit log: one redacted record per finished call (``AuditRecord``), kept in a capped Redis stream
and optionally a JSONL file (``AuditLog``). A sorted set indexes records by call id with the stream's
retention, so ``get`` is two cheap reads.
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import redis

from broker.envelope import filler
from broker.logs import MASK, is_secret_key, keyed_hash, redact, redact_text, sensitive_hashes

from . import keys, pipes, scripts
from .codec import WIRE_INTS, pack, text, unpack
from .errors import DecodeError
from .settings import DEFAULT_AUDIT_MAXLEN, AuditSettings

AUDIT_VERSION = 1
SUMMARY_LIMIT = 1024  # bytes of UTF-8 in a result summary
MAX_ARG_TEXT = 64 * 1024  # an argument string kept in a record (scanning megabytes for secrets would stall)
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
        digest: Any = None,
        **rest: Any,
    ) -> AuditRecord:
        """Build a record from raw call data: redacts args, hashes sensitive ones with ``digest``
        (``AuditLog.digest``; None: masked only), summarises the result."""
        if request is not None:
            rest.setdefault("model", request.get("model"))
            rest.setdefault("model_params", model_params(request))
        if isinstance(error, Mapping):
            rest.setdefault("error_type", str(error.get("type") or "error"))
            rest.setdefault("error_message", str(error.get("message") or ""))
        elif error is not None:
            rest.setdefault("error_type", str(getattr(error, "type", None) or type(error).__name__))
            rest.setdefault("error_message", str(error))
        if rest.get("error_message"):
            rest["error_message"] = redact_text(str(rest["error_message"]))
        unknown = set(rest).difference(_RECORD_FIELDS)
        if unknown:
            raise TypeError(f"AuditRecord has no field(s) {', '.join(sorted(unknown))}")
        # Not through the frozen dataclass's __init__: a worker builds one for every call it finishes.
        return _fill(
            dict(
                call_id=call_id,
                kind=kind,
                state=state,
                args=redact(dict(args), sensitive, MAX_ARG_TEXT, digest) if args is not None else None,
                sensitive_hashes=sensitive_hashes(args, sensitive, digest) if digest is not None else {},
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
        # Shallow on purpose: the values are already plain data (asdict's deep copy costs per call).
        values = self.__dict__
        return {name: values[name] for name in _RECORD_FIELDS}

    def encode(self) -> bytes:
        """The record packed; a value the wire cannot carry (an integer past 64 bits, a key that is not
        text) is kept as its text instead, so a call's end never fails on its audit record."""
        try:
            return pack(self.to_dict())
        except (TypeError, ValueError, OverflowError):
            return pack(_printable(self.to_dict()))

    @classmethod
    def from_dict(cls, data: Any) -> AuditRecord:
        if not isinstance(data, dict):
            raise DecodeError(f"audit record must be a mapping, got {type(data).__name__}")
        if data.get("version", AUDIT_VERSION) != AUDIT_VERSION:
            raise DecodeError(f"unsupported audit record version {data.get('version')!r}")
        try:  # unknown keys are dropped: a newer writer may add fields
            return cls(**{k: v for k, v in data.items() if k in _RECORD_FIELDS})
        except TypeError as e:
            raise DecodeError(f"audit record does not fit: {e}") from e

    @classmethod
    def decode(cls, data: bytes) -> AuditRecord:
        return cls.from_dict(unpack(data))

    def to_json(self) -> str:
        """One JSONL line (no newline)."""
        try:
            return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"), default=_json_default)
        except (TypeError, ValueError):  # (a key that is not text)
            return json.dumps(_printable(self.to_dict()), ensure_ascii=False, separators=(",", ":"))


CONTEXT_KEYS = (
    "principal", "session_id", "turn_id", "task_id", "api_request_id", "tool_call_id", "parent_call_id",
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
        if isinstance(value, str):  # sliced with room: a secret cut at the end lies past what is kept
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


def _printable(value: Any, depth: int = 0) -> Any:
    """``value`` with what msgpack or JSON cannot carry turned into text: keys, big integers, other types."""
    if depth > 64:
        return "..."
    if isinstance(value, dict):
        return {k if isinstance(k, str) else repr(k): _printable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(v, depth + 1) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str | float):
        return value
    if isinstance(value, int):
        return value if value in WIRE_INTS else str(value)
    return repr(value)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes | bytearray):
        return bytes(obj).decode("utf-8", errors="replace")
    if isinstance(obj, set | frozenset | tuple):
        return list(obj)
    return str(obj)


_RECORD_FIELDS = tuple(f.name for f in fields(AuditRecord))
_fill = filler(AuditRecord)
AUDIT_STREAM = keys.AUDIT_STREAM
AUDIT_INDEX = keys.AUDIT_INDEX


class AuditLog:
    """Append, look up, filter and export audit records. Needs a client with ``decode_responses=False``."""

    def __init__(
        self,
        redis: Any,
        key: str = AUDIT_STREAM,
        *,
        maxlen: int | None = DEFAULT_AUDIT_MAXLEN,
        max_age: float | None = None,
        approximate: bool = True,
        jsonl_path: str | os.PathLike[str] | None = None,
        clock: Any = time.time,
    ) -> None:
        self.redis = redis
        self.key = key
        self.index_key = AUDIT_INDEX if key == AUDIT_STREAM else key + ":idx"
        self.hash_key = f"{key}:key"  # where the secret of sensitive arguments' hashes is kept (``digest``)
        self.maxlen = int(maxlen or 0)
        self.max_age = float(max_age or 0)
        self.approximate = approximate
        self.jsonl_path = Path(jsonl_path) if jsonl_path else None
        self._clock = clock
        self._script = redis.register_script(scripts.for_server(redis, scripts.AUDIT_APPEND))
        self._file_lock = threading.Lock()

    @classmethod
    def from_settings(cls, redis: Any, audit: AuditSettings | None, **kw: Any) -> AuditLog:
        """From ``settings.audit``."""
        audit = audit or AuditSettings()
        return cls(
            redis, audit.key or AUDIT_STREAM, maxlen=audit.maxlen, max_age=audit.max_age,
            approximate=audit.approximate, jsonl_path=audit.jsonl, **kw
        )

    @functools.cached_property
    def digest(self) -> Any:
        """The hash of a sensitive argument in a record: HMAC-SHA256 under this deployment's key
        (``<stream>:key`` in Redis, made by the first process that needs it), never a plain sha256 anyone
        could match by hashing every 6-digit PIN."""
        make = self.redis.register_script(scripts.for_server(self.redis, scripts.AUDIT_KEY))
        return keyed_hash(make(keys=[self.hash_key], args=[os.urandom(32)]))

    def digest_now(self) -> Any:
        """``digest``, or None when Redis cannot give the key now (at maxmemory, or away): the record then masks
        a sensitive value only (a call's end must never fail for its audit record's hash)."""
        try:
            return self.digest
        except redis.RedisError:
            return None

    def append(self, record: AuditRecord, pipeline: Any = None) -> Any:
        """Add a record (into ``pipeline`` when given: only its creator executes it); mirrors to JSONL."""
        fields_ = [
            "call_id", record.call_id, "name", record.name, "principal", record.principal or "",
            "state", record.state, "d", record.encode(),
        ]
        client = pipeline if pipeline is not None else self.redis
        result = pipes.script(
            self._script, [self.key, self.index_key], self._trim_args(record.call_id) + fields_, client
        )
        if self.jsonl_path is not None:
            self._mirror(self.jsonl_path, record)
        return result

    def trim(self) -> None:
        """Apply retention now (appends do it too); for a periodic sweep of an idle log."""
        self._script(keys=[self.key, self.index_key], args=self._trim_args(""))

    def _trim_args(self, call_id: str) -> list[Any]:
        minid = int((self._clock() - self.max_age) * 1000) if self.max_age else 0
        return [self.maxlen, max(minid, 0), "~" if self.approximate else "=", call_id]

    def _mirror(self, path: Path, record: AuditRecord) -> None:
        line = (record.to_json() + "\n").encode("utf-8")
        with self._file_lock:  # one O_APPEND write per line: whole lines even with several processes
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def get(self, call_id: str) -> AuditRecord | None:
        """The latest record of a call, or None when there is none (or it was trimmed)."""
        ms = self.redis.zscore(self.index_key, call_id)
        if ms is None:
            return None
        ms = int(ms)
        entries = self.redis.xrange(self.key, f"{ms}-0", f"{ms}-18446744073709551615")
        found = [entry for _id, entry in entries if text(entry.get(b"call_id")) == call_id]
        return AuditRecord.decode(found[-1][b"d"]) if found else None

    def list(
        self,
        tool: str | None = None,
        principal: str | None = None,
        state: str | None = None,
        since: float | datetime | None = None,
        limit: int = 100,
        *,
        until: float | datetime | None = None,
        session_id: str | None = None,
    ) -> builtins.list[AuditRecord]:
        """Newest first, filtered by tool (or model), principal, final state, append time ``since`` /
        ``until`` and session id (read from each record: the stream entry does not carry it)."""
        out: builtins.list[AuditRecord] = []
        if limit <= 0:
            return out
        for rec in self._scan(tool, principal, state, since, until, newest_first=True):
            if session_id is not None and rec.session_id != session_id:
                continue
            out.append(rec)
            if len(out) >= limit:
                break
        return out

    def export(
        self,
        fp: IO[str],
        tool: str | None = None,
        principal: str | None = None,
        state: str | None = None,
        since: float | datetime | None = None,
        until: float | datetime | None = None,
    ) -> int:
        """Write matching records to ``fp`` as JSONL, oldest first; returns how many."""
        n = 0
        for rec in self._scan(tool, principal, state, since, until, newest_first=False):
            fp.write(rec.to_json() + "\n")
            n += 1
        return n

    def __len__(self) -> int:
        return int(self.redis.xlen(self.key))

    def _scan(
        self,
        tool: str | None,
        principal: str | None,
        state: str | None,
        since: float | datetime | None,
        until: float | datetime | None,
        *,
        newest_first: bool,
        batch: int = 500,
    ) -> Iterator[AuditRecord]:
        cursor_lo = _stream_id(since, "0") if since is not None else "-"
        cursor_hi = _stream_id(until, "18446744073709551615") if until is not None else "+"
        want = {b"name": tool, b"principal": principal, b"state": state}
        while True:
            if newest_first:
                page = self.redis.xrevrange(self.key, cursor_hi, cursor_lo, count=batch)
            else:
                page = self.redis.xrange(self.key, cursor_lo, cursor_hi, count=batch)
            for _sid, entry in page:  # filter on the plain fields first: most need no unpacking
                if all(v is None or text(entry.get(k)) == v for k, v in want.items()):
                    yield AuditRecord.decode(entry[b"d"])
            if len(page) < batch:
                return
            last = "(" + text(page[-1][0])
            cursor_hi, cursor_lo = (last, cursor_lo) if newest_first else (cursor_hi, last)


def _stream_id(when: float | datetime, seq: str) -> str:
    ts = when.timestamp() if isinstance(when, datetime) else float(when)
    return f"{int(ts * 1000)}-{seq}"
