"""``hermes-gateway migrate``: the v0.9 tool files (``$HERMES_HOME/tools.{json,yaml}``, ``tools/*``, and the
spec-shaped entries of ``tools:`` in ``config.yaml`` or a v0.9 ``config.json``, with older key names: ``RENAMES``,
``EXECUTOR_ALIASES``) converted, validated and registered; the config files are only read.
A different spec already in the directory is kept unless ``force``; per-file specs are rewritten in
the v0.10 shape (the original kept as ``*.v09.bak``). Running it again reports every tool "unchanged".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from broker.directory import Directory
from broker.errors import InvalidSpec
from broker.placeholders import load_yaml
from broker.toolspec import ToolSpec
from workers.specs import check_spec

RENAMES = {
    "type": "executor",
    "schema": "input_schema",
    "parameters": "input_schema",
    "returns": "output_schema",
    "tags": "permissions",
    "permission": "permissions",
    "max_concurrency": "concurrency",
    "cmd": "command",
    "sql": "query",
    "handler": "function",
}
EXECUTOR_ALIASES = {
    **dict.fromkeys(("shell", "cmd", "exec"), "command"),
    **dict.fromkeys(("rest", "api"), "http"),
    **dict.fromkeys(("sql", "db"), "database"),
    **dict.fromkeys(("py", "function"), "python"),
}
BACKUP_SUFFIX = ".v09.bak"


@dataclass(frozen=True)
class Outcome:
    """What happened to one spec: imported, updated, unchanged or skipped (with the reason)."""

    source: str
    name: str
    status: str
    version: int | None = None
    reason: str = ""
    failed: bool = False  # skipped because it could not be read or converted (not by choice)


@dataclass
class _Found:
    source: str
    raw: Any
    file: Path | None = None  # set for per-file specs under tools/, which may be rewritten


def upgrade_spec(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The v0.10 form of a v0.9 spec, and a note per key it changed."""
    out: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in raw.items():
        new = RENAMES.get(key, key)
        if new in raw and new != key:  # both spellings: the new one wins
            notes.append(f"{key} dropped ({new} is set)")
            continue
        if key == "timeout_ms":
            new, value = "timeout", _seconds(value)
        elif key == "retries":
            new, value = "retry", {"max": value} if not isinstance(value, dict) else value
        if new != key:
            notes.append(f"{key}→{new}")
        out[new] = value
    executor = out.get("executor")
    if isinstance(executor, str) and executor.lower() in EXECUTOR_ALIASES:
        out["executor"] = EXECUTOR_ALIASES[executor.lower()]
        notes.append(f"executor {executor}→{out['executor']}")
    if isinstance(out.get("permissions"), str):
        out["permissions"] = [out["permissions"]]
    out.pop("enabled", None)
    return out, notes


def _seconds(ms: Any) -> Any:
    if isinstance(ms, int | float) and not isinstance(ms, bool):
        return ms / 1000.0
    return ms  # left for validation to name


def find_legacy(home: Path) -> Iterator[_Found]:
    """Every spec of the v0.9 layout under ``home``, with where it came from."""
    for name in ("tools.json", "tools.yaml", "tools.yml"):
        path = home / name
        if path.is_file():
            yield from _entries(_read(path), path.name)
    for name in ("config.yaml", "config.json"):  # v0.9 also kept its tools in its own config file
        data = _read(home / name) if (home / name).is_file() else None
        if isinstance(data, dict) and isinstance(data.get("tools"), list | dict):
            # (spec-shaped entries only: a shared config.yaml may hold another program's `tools:` settings)
            specs = (f for f in _entries(data, name) if isinstance(f.raw, dict))
            yield from (f for f in specs if "type" in f.raw or "executor" in f.raw)
    tools = home / "tools"
    if tools.is_dir():
        files = sorted(p for p in tools.iterdir() if p.suffix in (".json", ".yaml", ".yml") and p.is_file())
        for path in files:
            data = _read(path)
            if isinstance(data, list | str) or (isinstance(data, dict) and "tools" in data):
                yield from _entries(data, f"tools/{path.name}")
            else:
                yield _Found(f"tools/{path.name}", data, path)


def _read(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text) if path.suffix == ".json" else load_yaml(text)
    except (ValueError, yaml.YAMLError) as e:
        return _Unreadable(f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}".splitlines()[0])


@dataclass(frozen=True)
class _Unreadable:
    reason: str


def _entries(data: Any, label: str) -> Iterator[_Found]:
    if isinstance(data, _Unreadable):
        yield _Found(label, data)
        return
    if isinstance(data, dict) and isinstance(data.get("tools"), list | dict):
        data = data["tools"]
    if isinstance(data, dict):  # {name: spec}
        for i, (name, spec) in enumerate(data.items()):
            yield _Found(f"{label}[{i}]", {"name": name, **spec} if isinstance(spec, dict) else spec)
    elif isinstance(data, list):
        for i, spec in enumerate(data):
            yield _Found(f"{label}[{i}]", spec)
    else:
        yield _Found(label, _Unreadable(f"expected a list of tool specs, got {type(data).__name__}"))


def migrate(
    directory: Directory,
    home: Path,
    *,
    force: bool = False,
    rewrite: bool = True,
    dry_run: bool = False,
    to_files: bool = False,
) -> list[Outcome]:
    """Import every v0.9 spec under ``home``; one Outcome per spec found, in the order found. ``to_files``
    also writes the list files' specs to new ``tools/<name>.yaml`` files (an embedded broker's directory
    ends with the command, the files do not)."""
    out: list[Outcome] = []
    seen: dict[str, tuple[str, str]] = {}  # name -> (source, digest)
    for found in list(find_legacy(home)):  # (found before any is written: a spec file this run writes is no source)
        raw = found.raw
        if not isinstance(raw, dict):
            why = raw.reason if isinstance(raw, _Unreadable) else f"expected a mapping, got {type(raw).__name__}"
            out.append(Outcome(found.source, "?", "skipped", reason=why, failed=True))
            continue
        name = str(raw.get("name") or (found.file.stem if found.file else "?"))
        if raw.get("enabled") is False:
            out.append(Outcome(found.source, name, "skipped", reason="disabled in v0.9 (enabled: false)"))
            continue
        data, notes = upgrade_spec(raw)
        if found.file is not None and "name" not in data:
            data["name"] = name
        try:
            spec = check_spec(data)
        except InvalidSpec as e:
            out.append(Outcome(found.source, name, "skipped", reason=e.message, failed=True))
            continue
        earlier = seen.get(spec.name)
        if earlier is not None and earlier[1] != spec.digest():
            why = f"another spec named so in {earlier[0]}"
            out.append(Outcome(found.source, spec.name, "skipped", reason=why, failed=True))
            continue
        converted = notes or (found.file is not None and found.file.suffix == ".json")
        if earlier is not None:  # the same spec twice (a list file's and the tools/<name>.yaml an earlier run wrote): one tool
            if rewrite and not dry_run and found.file is not None and converted:
                _rewrite(found.file, data)  # (a per-file copy in the old shape is still brought up to date)
            continue
        seen[spec.name] = (found.source, spec.digest())
        outcome = _register(directory, spec, found.source, notes, force, dry_run)
        out.append(outcome)
        if rewrite and not dry_run and found.file is not None and converted and outcome.status != "skipped":
            _rewrite(found.file, data)
        target = home / "tools" / f"{spec.name}.yaml"
        if to_files and not dry_run and found.file is None and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(_converted(found.source, data), encoding="utf-8")
    return out


def _register(
    directory: Directory, spec: ToolSpec, source: str, notes: list[str], force: bool, dry_run: bool
) -> Outcome:
    why = ", ".join(notes)
    if dry_run:
        current = directory.fetch(spec.name)
        if current is None:
            return Outcome(source, spec.name, "imported", reason=f"would import {why}".strip())
        if current.spec.digest() == spec.digest():
            return Outcome(source, spec.name, "unchanged", current.version)
        status = "updated" if force else "skipped"
        return Outcome(source, spec.name, status, current.version, "differs from the directory's spec")
    version, outcome = directory.put(spec, replace=force)
    if outcome == "kept":
        why = f"the directory holds a different {spec.name!r} (version {version}); --force replaces it"
        return Outcome(source, spec.name, "skipped", version, why)
    status = {"added": "imported", "updated": "updated", "unchanged": "unchanged"}[outcome]
    return Outcome(source, spec.name, status, version, why)


def _rewrite(path: Path, data: dict[str, Any]) -> None:
    """Write the v0.10 form beside the original (kept as ``*.v09.bak``), so ``tool list`` can read it."""
    target = path.with_suffix(".yaml")
    backup = path.with_name(path.name + BACKUP_SUFFIX)
    if not backup.exists():
        path.rename(backup)
    elif path != target:
        path.unlink()
    target.write_text(_converted(backup.name, data), encoding="utf-8")


def _converted(source: str, data: dict[str, Any]) -> str:
    header = f"# converted from v0.9 ({source}) by `hermes-gateway migrate`\n"
    return header + yaml.safe_dump(data, allow_unicode=True, sort_keys=False)
