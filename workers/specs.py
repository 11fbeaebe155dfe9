"""Registration: a tool spec as written (a mapping, a YAML file or text) checked into a ``ToolSpec``.

``check_spec`` is the one check every registering path calls: what every spec has (``ToolSpec.from_dict``),
then its executor's keys and ``check``. The directory (``broker/``) stores what it checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from broker.codec import nesting
from broker.directory import Directory
from broker.errors import InvalidSpec
from broker.placeholders import load_yaml
from broker.specchecks import check_keys
from broker.toolspec import COMMON_KEYS, ROUTING_KEYS, ToolSpec

from .executors import EXECUTORS, executor_class

# Keys only a v0.9 spec file has (see hermes_gateway/migrate.py).
_V09_KEYS = frozenset({"type", "schema", "parameters", "timeout_ms", "tags", "cmd", "handler", "retries"})


SPEC_DEPTH = 64  # levels of lists and mappings a spec (its input schema, mostly) may nest


def check_spec(data: Any) -> ToolSpec:
    """The spec ``data`` describes, checked as registration checks it; InvalidSpec names the field path."""
    if isinstance(data, ToolSpec):
        data = data.to_dict()
    if nesting(data, SPEC_DEPTH) > SPEC_DEPTH:  # (a JSON Schema checker recurses: ~100 levels overflow it)
        raise InvalidSpec(f"the spec is nested too deeply (more than {SPEC_DEPTH} levels)")
    spec = ToolSpec.from_dict(data)
    where = f"tool {spec.name!r}"
    if spec.executor not in EXECUTORS:
        raise InvalidSpec(
            f"{where}: tool executor not found: {spec.executor!r} (executor: expected one of {', '.join(EXECUTORS)})",
            path="executor",
        )
    cls = executor_class(spec.executor)
    check_keys(where, f"a {spec.executor} tool", data, COMMON_KEYS | ROUTING_KEYS | cls.keys)
    cls.check(where, data)
    return spec


def load_spec_file(path: Path) -> ToolSpec:
    """Read one YAML spec; errors name the file."""
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise InvalidSpec(f"{path}: not valid YAML: {yaml_problem(e)}") from e
    except UnicodeError as e:
        raise InvalidSpec(f"{path}: not UTF-8 text: {e}") from e
    except OSError as e:  # a dangling symlink, a file removed meanwhile, no permission
        raise InvalidSpec(f"{path}: cannot be read: {e.strerror or e}") from e
    try:
        return check_spec(data)
    except InvalidSpec as e:
        hint = ""
        if isinstance(data, dict) and _V09_KEYS & set(data):
            hint = " (this looks like a v0.9 spec: `hermes-gateway migrate` converts it)"
        raise InvalidSpec(f"{path}: {e.message}{hint}", **e.details) from e


def yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line: "line L, column C: problem (while ... at line L, column C)"."""

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

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
    """A spec sent as YAML text (the console, ``POST /v1/tools`` ``{"yaml": ...}``), read with the spec
    files' loader, holding only what a JSON body could, in a bounded amount (aliases can repeat a node
    exponentially often)."""
    try:
        data = load_yaml(text)
        _json_values(data, "", [YAML_NODES])
    except yaml.YAMLError as e:
        raise InvalidSpec(f"the spec is not valid YAML: {e}", path="yaml") from e
    except RecursionError as e:
        raise InvalidSpec("the spec is nested too deeply", path="yaml") from e
    return check_spec(data)


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
    """Every ``*.yaml``/``*.yml`` spec in a directory, sorted by file name; with ``errors``, a file that
    does not load is appended there and the others still load, else the first bad file raises."""
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
