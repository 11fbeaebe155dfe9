"""``mcp add``, ``mcp list``, ``mcp remove``: an MCP server's tools as ``mcp`` tools of the directory,
found again by the server's label."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from broker.directory import Directory
from broker.errors import HermesError, InvalidSpec
from broker.toolspec import ToolSpec
from workers.executors.mcp import list_server_tools
from workers.specs import check_spec

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True)
class Imported:
    """One server tool: added, updated, unchanged or skipped (why)."""

    name: str
    status: str
    version: int | None = None
    reason: str = ""


def import_server(
    directory: Directory,
    server: dict[str, Any],
    *,
    prefix: str = "",
    handshake_timeout: float = 10.0,
    write_dir: Path | None = None,
    label: str = "",
    tools_dir: Path | None = None,
    force: bool = False,
) -> list[Imported]:
    """List the server's tools and register each as ``prefix + tool``, its spec's ``mcp_server`` being
    ``label``; raises when the server is unreachable. ``write_dir``: each spec also as a YAML file there
    (an embedded broker's directory ends with the command). A tool of another origin of the same name, in
    the directory or as ``<tools_dir>/<name>.yaml``, is replaced only with ``force``, else ``ToolExists``
    names them all and nothing is registered."""
    listing = dict(server)
    if not _stderr_is_a_file():
        listing["stderr"] = "discard"  # the SDK hands the server our stderr, which must be a real file
    found_tools = list_server_tools(listing, handshake_timeout=handshake_timeout)
    # Directory names a model API accepts (the server's own name stays in ``tool:``, for the executor).
    names = [_UNSAFE.sub("_", f"{prefix}{found['name']}")[:64] for found in found_tools]
    taken = [] if force else [what for name in names if (what := _taken(directory, tools_dir, name, label))]
    if taken:
        raise ToolExists(
            f"{'; '.join(taken)}: `--force` replaces them, or `--prefix` imports beside them (nothing imported)"
        )
    out = []
    for found, name in zip(found_tools, names, strict=True):
        data = {**found, "name": name, "mcp": server}
        if label:
            data["mcp_server"] = label
        try:
            spec = check_spec(data)
        except InvalidSpec as e:
            # A server's schema that is not valid JSON Schema would mislead the model: name it, go on.
            out.append(Imported(data["name"], "skipped", reason=e.message))
            continue
        version, outcome = directory.put(spec)
        out.append(Imported(spec.name, outcome, version))
        if write_dir is not None:
            write_dir.mkdir(parents=True, exist_ok=True)
            (write_dir / f"{spec.name}.yaml").write_text(
                yaml.safe_dump(spec.to_dict(), allow_unicode=True, sort_keys=False), encoding="utf-8"
            )
    return out


class ToolExists(HermesError):
    """``mcp add`` would replace a tool that is not this server's (without ``--force``)."""


def _imported_from(data: Any, label: str) -> bool:
    return isinstance(data, dict) and data.get("executor") == "mcp" and data.get("mcp_server") == label


def _taken(directory: Directory, tools_dir: Path | None, name: str, label: str) -> str:
    """What a tool named ``name`` imported from ``label`` would replace ('' when nothing of another origin)."""
    entry = directory.fetch(name)
    if entry is not None and not _imported_from(entry.spec.to_dict(), label):
        return f"a tool named {name!r} exists ({entry.spec.executor}, not from MCP server {label!r})"
    if tools_dir is not None and (path := tools_dir / f"{name}.yaml").exists():
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            data = None
        if not _imported_from(data, label):
            return f"{path} defines a tool {name!r} that every command loads"
    return ""


def servers(directory: Directory) -> dict[str, list[ToolSpec]]:
    """The tools ``mcp add`` imported, by server label (tools registered by hand have none)."""
    out: dict[str, list[ToolSpec]] = {}
    for entry in sorted(directory.all(), key=lambda e: e.spec.name):
        label = entry.spec.config.get("mcp_server") if entry.spec.executor == "mcp" else None
        if label:
            out.setdefault(str(label), []).append(entry.spec)
    return dict(sorted(out.items()))


def remove_server(directory: Directory, label: str, write_dir: Path | None = None) -> list[str]:
    """Remove every tool imported under ``label`` (and its YAML file in ``write_dir``); their names."""
    removed = []
    for spec in servers(directory).get(label, []):
        if directory.remove(spec.name):
            removed.append(spec.name)
        if write_dir is not None:
            (write_dir / f"{spec.name}.yaml").unlink(missing_ok=True)
    return removed


def _stderr_is_a_file() -> bool:
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True
