"""The audit log: one record per finished call, in a capped Redis stream (and optionally a JSONL file).

Each record is written by the same pipeline that finishes the call, so a call is never done without
its record. The stream is trimmed by count and/or age; a sorted set indexes records by call id with
the same retention, so ``get`` is two cheap reads and the index never outgrows the stream.
"""

from __future__ import annotations

import builtins
import os
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from . import keys, pipes, scripts
from .audit import AuditRecord
from .settings import DEFAULT_AUDIT_MAXLEN, AuditSettings

AUDIT_STREAM = keys.AUDIT_STREAM
AUDIT_INDEX = keys.AUDIT_INDEX
DEFAULT_MAXLEN = DEFAULT_AUDIT_MAXLEN


class AuditLog:
    """Append, look up, filter and export audit records. Needs a client with ``decode_responses=False``."""

    def __init__(
        self,
        redis: Any,
        key: str = AUDIT_STREAM,
        *,
        index_key: str | None = None,
        maxlen: int | None = DEFAULT_MAXLEN,
        max_age: float | None = None,
        approximate: bool = True,
        jsonl_path: str | os.PathLike[str] | None = None,
        clock: Any = time.time,
    ) -> None:
        self.redis = redis
        self.key = key
        self.index_key = index_key or (AUDIT_INDEX if key == AUDIT_STREAM else key + ":idx")
        self.maxlen = int(maxlen or 0)
        self.max_age = float(max_age or 0)
        self.approximate = approximate
        self.jsonl_path = Path(jsonl_path) if jsonl_path else None
        self._clock = clock
        self._script = redis.register_script(scripts.for_server(redis, scripts.AUDIT_APPEND))
        self._file_lock = threading.Lock()

    @classmethod
    def from_settings(cls, redis: Any, audit: AuditSettings | None, **kw: Any) -> AuditLog:
        """From ``settings.audit`` (``broker.config`` parsed and checked it)."""
        audit = audit or AuditSettings()
        return cls(
            redis,
            audit.key or AUDIT_STREAM,
            maxlen=audit.maxlen,
            max_age=audit.max_age,
            approximate=audit.approximate,
            jsonl_path=audit.jsonl,
            **kw,
        )

    # --- writing ----------------------------------------------------------------------------------

    def append(self, record: AuditRecord, pipeline: Any = None) -> Any:
        """Add a record (into ``pipeline`` when given: only its creator executes it); mirrors to JSONL."""
        fields_ = [
            "call_id",
            record.call_id,
            "name",
            record.name,
            "principal",
            record.principal or "",
            "state",
            record.state,
            "d",
            record.encode(),
        ]
        client = pipeline if pipeline is not None else self.redis
        result = pipes.script(
            self._script, [self.key, self.index_key], self._trim_args(record.call_id) + fields_, client
        )
        if self.jsonl_path is not None:
            self._mirror(record)
        return result

    def trim(self) -> None:
        """Apply retention now (appends do it too); for a periodic sweep of an idle log."""
        self._script(keys=[self.key, self.index_key], args=self._trim_args(""))

    def _trim_args(self, call_id: str) -> list[Any]:
        minid = int((self._clock() - self.max_age) * 1000) if self.max_age else 0
        return [self.maxlen, max(minid, 0), "~" if self.approximate else "=", call_id]

    def _mirror(self, record: AuditRecord) -> None:
        line = (record.to_json() + "\n").encode("utf-8")
        assert self.jsonl_path is not None
        with self._file_lock:
            # One O_APPEND write per line: whole lines even with several processes on one file.
            fd = os.open(self.jsonl_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    # --- reading ----------------------------------------------------------------------------------

    def get(self, call_id: str) -> AuditRecord | None:
        """The latest record of a call, or None when there is none (or it was trimmed)."""
        ms = self.redis.zscore(self.index_key, call_id)
        if ms is None:
            return None
        ms = int(ms)
        found = None
        for _id, entry in self.redis.xrange(self.key, f"{ms}-0", f"{ms}-18446744073709551615"):
            if _text(entry.get(b"call_id")) == call_id:
                found = entry
        return AuditRecord.decode(found[b"d"]) if found is not None else None

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
        lo = _stream_id(since, "0") if since is not None else "-"
        hi = _stream_id(until, "18446744073709551615") if until is not None else "+"
        want = {b"name": tool, b"principal": principal, b"state": state}
        cursor_lo, cursor_hi = lo, hi
        while True:
            if newest_first:
                page = self.redis.xrevrange(self.key, cursor_hi, cursor_lo, count=batch)
            else:
                page = self.redis.xrange(self.key, cursor_lo, cursor_hi, count=batch)
            for _sid, entry in page:
                # Filter on the plain fields first: most entries never need unpacking.
                if all(v is None or _text(entry.get(k)) == v for k, v in want.items()):
                    yield AuditRecord.decode(entry[b"d"])
            if len(page) < batch:
                return
            last = _text(page[-1][0])
            if newest_first:
                cursor_hi = "(" + last
            else:
                cursor_lo = "(" + last


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value or "")


def _stream_id(when: float | datetime, seq: str) -> str:
    ts = when.timestamp() if isinstance(when, datetime) else float(when)
    return f"{int(ts * 1000)}-{seq}"
