"""Which strings of a call are paths: what ``policy.args.path_prefixes`` judges.

A path rule's list form (``read_file: [/srv/data/]``) judges every path-like string of the effective
arguments, at any depth: one whose name says path (``path``, ``filePath``, ``log-dir``, ``paths``,
``opts.src``...), one the ``input_schema`` declares ``format: path``, and, for a ``command`` tool, every
string filling a placeholder of its argv or of an ``env_set`` variable whose name says path. Under a
path-like name, anything but a string (or list of strings) is refused. The mapping form (``{args: [dest,
opts.path], allow: [...]}``) judges exactly the arguments it names.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from itertools import chain
from typing import Any

from broker.placeholders import OMIT, lookup, names
from broker.toolspec import ToolSpec

# A name's last word that makes it path-like, and word runs that end one (``file_name`` -> "filename").
PATH_WORDS = frozenset(
    {"path", "paths", "file", "files", "dir", "dirs", "directory", "directories", "folder", "folders"}
    | {"cwd", "dest", "src"}
)
PATH_ENDINGS = ("filename", "filenames", "filepath", "filepaths", "pathname", "dirname", "dirpath")
PATH_FORMATS = frozenset({"path", "file-path", "directory-path", "filepath", "dir-path"})
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_SPLIT = re.compile(r"[^A-Za-z0-9]+")


def path_like(name: str) -> bool:
    """True when an argument (or environment variable) name says it holds a path."""
    words = [w for w in _SPLIT.split(_CAMEL.sub(r"\1_\2", name).lower()) if w]
    return bool(words) and (words[-1] in PATH_WORDS or "".join(words).endswith(PATH_ENDINGS))


def every_path(spec: ToolSpec, args: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(where, value)`` for every path-like value of the call, each place once."""
    found: dict[str, Any] = {}
    sources = [_by_name(args, ""), _by_schema(spec.input_schema, args, "")]
    if spec.executor == "command":
        sources.append(_by_position(spec.config, args))
    for where, value in chain(*sources):
        found.setdefault(where, value)
    return list(found.items())


def named(names: tuple[str, ...], args: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(name, value)`` for each of ``names`` the call has (``opts.path`` is followed into ``opts``)."""
    return [(name, value) for name in names if (value := lookup(args, name)) is not OMIT]


def _by_name(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            here = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and path_like(key) and not _holds_mapping(item):
                yield here, item
            else:
                yield from _by_name(item, here)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _by_name(item, f"{where}[{i}]")


def _holds_mapping(value: Any) -> bool:
    """A mapping, or a list with one: searched by name inside rather than judged as a path itself."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, list | tuple) and any(isinstance(v, Mapping) for v in value)


def _by_schema(schema: Any, value: Any, where: str) -> Iterator[tuple[str, Any]]:
    if not isinstance(schema, Mapping):
        return
    if schema.get("format") in PATH_FORMATS and where:
        yield where, value
        return
    if isinstance(value, Mapping):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra) if isinstance(props, Mapping) else extra
            yield from _by_schema(sub, item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _by_schema(schema.get("items"), item, f"{where}[{i}]")


def _by_position(config: Mapping[str, Any], args: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    template = config.get("command")
    try:
        parts = shlex.split(template) if isinstance(template, str) else [str(p) for p in template or ()]
    except ValueError:
        parts = []  # the executor refuses this spec itself
    for part in parts[1:]:
        for name, value in _filled(part, args):
            yield f"{name} (argv)", value
    env_set = config.get("env_set")
    if isinstance(env_set, Mapping):
        for var, text in env_set.items():
            if path_like(str(var)):
                for name, value in _filled(str(text), args):
                    yield f"{name} (env {var})", value


def _filled(template: str, args: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """``(placeholder, string)`` for each placeholder of ``template`` the call fills with a string."""
    for name in names(template):
        value = lookup(args, name)
        if isinstance(value, str):
            yield name, value
