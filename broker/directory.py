"""The tool directory in Redis, shared by every client, worker and gateway instance."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import structlog
import yaml

from . import keys, scripts
from .codec import pack, text, unpack
from .errors import HermesError, InvalidSpec, UnknownTool
from .toolspec import ToolSpec
from .yamlload import load_yaml

OUTCOMES = ("unchanged", "added", "updated", "kept")
log = structlog.get_logger("hermes.directory")

# Keys only a v0.9 spec file has (see hermes_gateway/migrate.py).
_V09_KEYS = frozenset({"type", "schema", "parameters", "timeout_ms", "tags", "cmd", "handler", "retries"})


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

    def register(self, spec: ToolSpec | dict[str, Any]) -> tuple[int, bool]:
        """Store a spec; returns (version, changed)."""
        version, outcome = self.put(spec)
        return version, outcome != "unchanged"

    def put(self, spec: ToolSpec | dict[str, Any], *, replace: bool = True) -> tuple[int, str]:
        """Store a spec; returns (version, outcome), outcome one of ``OUTCOMES``.

        With ``replace=False`` a different spec already registered under the name is kept ("kept").
        """
        if not isinstance(spec, ToolSpec):
            spec = ToolSpec.from_dict(spec)
        version, outcome = self._register(
            keys=[keys.TOOLS, keys.TOOLS_VERSION, keys.TOOLS_DIGEST, keys.TOOLS_VER],
            args=[
                spec.name,
                spec.digest(),
                pack(spec.to_dict()),
                keys.channel(self.conn, keys.TOOLS_CHANNEL),
                1 if replace else 0,
            ],
        )
        return int(version), OUTCOMES[int(outcome)]

    def remove(self, name: str) -> bool:
        """Delete a tool; every instance is told over pub/sub. True when it existed."""
        pipe = self.conn.pipeline()
        pipe.hdel(keys.TOOLS, name)
        pipe.hdel(keys.TOOLS_DIGEST, name)
        pipe.hdel(keys.TOOLS_VER, name)
        pipe.incr(keys.TOOLS_VERSION)
        removed = pipe.execute()[0]  # (one slot, {hermes:dir}: a transaction on a cluster too)
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
        if entry is None or entry.version < min_version:
            generation = self._generation
            fresh = self.fetch(name)
            if fresh is None:
                raise UnknownTool(f"unknown tool {name!r}: it is not in the tool directory", tool=name)
            with self._lock:
                if generation == self._generation:
                    self._cache[name] = fresh
            entry = fresh
        return entry

    def invalidate(self, name: str | None = None) -> None:
        """Drop cached entries (one, or all) after a change notice."""
        with self._lock:
            self._generation += 1
            if name is None:
                self._cache.clear()
            else:
                self._cache.pop(name, None)

    def all(self) -> list[Entry]:
        """Every entry, sorted by name (read from Redis, not the cache); one that does not decode is
        skipped with a warning naming it (``readable``)."""
        pipe = self.conn.pipeline(transaction=False)
        pipe.hgetall(keys.TOOLS)
        pipe.hgetall(keys.TOOLS_VER)
        raw, vers = pipe.execute()
        return readable(raw, vers)


_warned: set[tuple[bytes, int]] = set()  # (name, hash of the bad entry): each is warned about once


def readable(raw: dict[Any, Any], vers: dict[Any, Any]) -> list[Entry]:
    """The entries of the tools hash ``raw`` (versions ``vers``) that decode, sorted by name. An entry that
    does not (damaged, or written by something else) is skipped, so one bad entry leaves the listing, the
    schemas and the other tools usable; a warning names it, once."""
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


def load_spec_file(path: Path) -> ToolSpec:
    """Read one YAML spec; errors name the file."""
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        # One line naming the place and the problem; PyYAML's own multi-line text stays the cause.
        raise InvalidSpec(f"{path}: not valid YAML: {yaml_problem(e)}") from e
    except UnicodeError as e:
        raise InvalidSpec(f"{path}: not UTF-8 text: {e}") from e
    except OSError as e:  # a dangling symlink, a file removed meanwhile, no permission
        raise InvalidSpec(f"{path}: cannot be read: {e.strerror or e}") from e
    try:
        return ToolSpec.from_dict(data)
    except InvalidSpec as e:
        hint = ""
        if isinstance(data, dict) and _V09_KEYS & set(data):
            hint = " (this looks like a v0.9 spec: `hermes-gateway migrate` converts it)"
        raise InvalidSpec(f"{path}: {e.message}{hint}", **e.details) from e


def yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line: "line L, column C: problem (while ... at line L, column C)"."""

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    problem = getattr(e, "problem", None)
    if not problem:
        return " ".join(str(e).split())
    mark = getattr(e, "problem_mark", None)
    text = f"{at(mark)}: {problem}" if mark is not None else str(problem)
    context = getattr(e, "context", None)
    if context:
        context_mark = getattr(e, "context_mark", None)
        text += f" ({context}{' at ' + at(context_mark) if context_mark is not None else ''})"
    return text


YAML_NODES = 100_000  # values a YAML spec sent as text may hold, aliases expanded (a spec is a few hundred)


def spec_from_yaml_text(text: str) -> ToolSpec:
    """A spec sent as YAML text (the console's register form, ``POST /v1/tools`` ``{"yaml": ...}``): read
    with the spec files' loader (``{{field}}`` placeholders kept), and only what a JSON body could hold,
    in a bounded amount (YAML also reads dates, binary and sets, and aliases can repeat one node
    exponentially often)."""
    try:
        data = load_yaml(text)
        _json_values(data, "", [YAML_NODES])
    except yaml.YAMLError as e:
        raise InvalidSpec(f"the spec is not valid YAML: {e}", path="yaml") from e
    except RecursionError as e:
        raise InvalidSpec("the spec is nested too deeply", path="yaml") from e
    return ToolSpec.from_dict(data)


def _json_values(value: Any, path: str, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise InvalidSpec(f"the spec is too large (more than {YAML_NODES} values once YAML aliases are expanded)")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidSpec(f"tool spec.{path or '(top)'}: keys must be strings, got {k!r}", path=path)
            _json_values(v, f"{path}.{k}" if path else k, budget)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _json_values(v, f"{path}[{i}]", budget)
    elif not (value is None or isinstance(value, str | int | float | bool)):
        raise InvalidSpec(
            f"tool spec.{path or '(top)'}: YAML read a {type(value).__name__}, which JSON has no value for "
            "(quote it to mean text)",
            path=path,
        )


def load_spec_dir(path: Path, errors: list[InvalidSpec] | None = None) -> list[ToolSpec]:
    """Every ``*.yaml``/``*.yml`` spec in a directory, sorted by file name.

    With ``errors``, a file that does not load is appended there (its message names the file) and the
    others still load; without, the first bad file raises.
    """
    if not path.is_dir():
        return []
    # (not hidden files: an editor's lock or backup, such as Emacs's .#name.yaml)
    files = sorted(f for f in [*path.glob("*.yaml"), *path.glob("*.yml")] if not f.name.startswith("."))
    specs = []
    for f in files:
        try:
            specs.append(load_spec_file(f))
        except InvalidSpec as e:
            if errors is None:
                raise
            errors.append(e)
    return specs


def sync_dir(directory: Directory, path: Path, errors: list[InvalidSpec] | None = None) -> list[tuple[str, int, bool]]:
    """Register every spec file of ``path``; returns (name, version, changed) per tool (``errors``: as
    ``load_spec_dir``)."""
    return [(spec.name, *directory.register(spec)) for spec in load_spec_dir(path, errors)]
