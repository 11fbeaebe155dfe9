"""The tool directory in Redis, shared by every client, worker and gateway instance.

It stores and reads specs; it does not check them (registration does: ``workers/specs.py``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from . import keys, scripts
from .breaker import Breakers
from .codec import pack, text, unpack
from .errors import HermesError, UnknownTool
from .ratelimits import RateLimiter
from .toolspec import ToolSpec

OUTCOMES = ("unchanged", "added", "updated", "kept")
log = structlog.get_logger("hermes.directory")


@dataclass(frozen=True)
class Entry:
    """A directory entry: the spec and the version it was registered at."""

    spec: ToolSpec
    version: int


class Directory:
    """Register, read and remove tool specs."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._register = conn.register_script(scripts.TOOL_REGISTER)
        self._cache: dict[str, Entry] = {}
        self._lock = threading.Lock()
        # Bumped by every invalidation: a fetch that raced a change notice must not re-cache what it read.
        self._generation = 0

    def register(self, spec: ToolSpec) -> tuple[int, bool]:
        """Store a spec; returns (version, changed)."""
        version, outcome = self.put(spec)
        return version, outcome != "unchanged"

    def put(self, spec: ToolSpec, *, replace: bool = True) -> tuple[int, str]:
        """Store a spec checked by its caller (``workers.specs.check_spec``); returns (version, outcome), one
        of ``OUTCOMES`` ("kept": ``replace=False`` and a different spec is registered under the name)."""
        channel = keys.channel(self.conn, keys.TOOLS_CHANNEL)
        generation = self._generation
        version, outcome = self._register(
            keys=[keys.TOOLS, keys.TOOLS_VERSION, keys.TOOLS_DIGEST, keys.TOOLS_VER],
            args=[spec.name, spec.digest(), pack(spec.to_dict()), channel, int(replace)],
        )
        result = OUTCOMES[int(outcome)]
        if result in ("added", "updated"):
            RateLimiter(self.conn).apply(spec)
        with self._lock:  # this process's next call uses it now, not after its own change notice comes back
            newer = generation != self._generation  # (a change notice came meanwhile: maybe a newer spec)
            self._generation += 1
            if result == "kept" or newer:
                self._cache.pop(spec.name, None)
            else:
                self._cache[spec.name] = Entry(ToolSpec.from_stored(spec.to_dict()), int(version))
        return int(version), result

    def remove(self, name: str) -> bool:
        """Delete a tool; every instance is told over pub/sub. True when it existed."""
        pipe = self.conn.pipeline()
        for key in (keys.TOOLS, keys.TOOLS_DIGEST, keys.TOOLS_VER):
            pipe.hdel(key, name)
        pipe.incr(keys.TOOLS_VERSION)
        removed = pipe.execute()[0]  # (one slot, {hermes:dir}: a transaction on a cluster too)
        if removed:  # its own breaker goes with it (an open one stayed open on every surface, for ever)
            Breakers(self.conn).reset(f"tool:{name}")
        self.conn.publish(keys.channel(self.conn, keys.TOOLS_CHANNEL), name)
        with self._lock:
            self._cache.pop(name, None)
        return bool(removed)

    def fetch(self, name: str) -> Entry | None:
        """Read one entry from Redis (no cache)."""
        pipe = self.conn.pipeline(transaction=False)
        pipe.hget(keys.TOOLS, name)
        pipe.hget(keys.TOOLS_VER, name)
        raw, ver = pipe.execute()
        if raw is None:
            return None
        return Entry(ToolSpec.from_stored(unpack(raw)), int(ver or 0))

    def get(self, name: str, min_version: int = 0) -> Entry:
        """A spec at least as new as ``min_version``: the cache serves only when it is new enough."""
        entry = self._cache.get(name)
        if entry is not None and entry.version >= min_version:
            return entry
        generation = self._generation
        fresh = self.fetch(name)
        if fresh is None:
            raise UnknownTool(f"unknown tool {name!r}: it is not in the tool directory", tool=name)
        with self._lock:
            if generation == self._generation:
                self._cache[name] = fresh
        return fresh

    def invalidate(self, name: str | None = None) -> None:
        """Drop cached entries (one, or all) after a change notice."""
        with self._lock:
            self._generation += 1
            if name is None:
                self._cache.clear()
            else:
                self._cache.pop(name, None)

    def all(self) -> list[Entry]:
        """Every entry that decodes (``readable``), sorted by name, read from Redis (not the cache)."""
        pipe = self.conn.pipeline(transaction=False)
        pipe.hgetall(keys.TOOLS)
        pipe.hgetall(keys.TOOLS_VER)
        raw, vers = pipe.execute()
        return readable(raw, vers)


_warned: set[tuple[bytes, int]] = set()  # (name, hash of the bad entry): each is warned about once


def readable(raw: dict[Any, Any], vers: dict[Any, Any]) -> list[Entry]:
    """The entries of the tools hash ``raw`` (versions ``vers``) that decode, sorted by name; one that does
    not is skipped (the other tools stay usable) with a warning naming it, once."""
    out = []
    for name, packed in sorted(raw.items()):
        try:
            out.append(Entry(ToolSpec.from_stored(unpack(packed)), int(vers.get(name, 0))))
        except (HermesError, TypeError, ValueError, KeyError, AttributeError) as e:
            mark = (bytes(name) if isinstance(name, bytes | bytearray) else str(name).encode(), hash(bytes(packed)))
            if mark not in _warned:
                if len(_warned) > 10_000:
                    _warned.clear()
                _warned.add(mark)
                log.warning("tool directory entry skipped: it does not decode", tool=text(name), error=str(e))
    return out
