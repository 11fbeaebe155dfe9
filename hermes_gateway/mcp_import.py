"""``mcp add``: an MCP server's tools become ``mcp`` tools in the directory, one report line each;
``mcp list`` and ``mcp remove`` find them again by the server's label."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from broker.directory import Directory
from broker.errors import InvalidSpec
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
) -> list[Imported]:
    """List the server's tools and register each (named ``prefix + tool``); raises when it is unreachable.

    ``label`` (the SERVER_NAME of ``mcp add``) is stored in each spec as ``mcp_server``.

    ``write_dir`` also writes each spec to ``<write_dir>/<name>.yaml`` (for an embedded broker, whose
    directory ends with the command).
    """
    listing = dict(server)
    if not _stderr_is_a_file():
        listing["stderr"] = "discard"  # the SDK hands the server our stderr, which must be a real file
    out = []
    for found in list_server_tools(listing, handshake_timeout=handshake_timeout):
        # The server's own name stays in ``tool:`` (what the executor calls); the directory name must be
        # one a model API accepts, so other characters become '_'.
        data = {**found, "name": _UNSAFE.sub("_", f"{prefix}{found['name']}")[:64], "mcp": server}
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


def servers(directory: Directory) -> dict[str, list[ToolSpec]]:
    """The tools ``mcp add`` imported, by server label (tools registered by hand have none)."""
    out: dict[str, list[ToolSpec]] = {}
    for entry in directory.all():
        label = entry.spec.config.get("mcp_server") if entry.spec.executor == "mcp" else None
        if label:
            out.setdefault(str(label), []).append(entry.spec)
    for specs in out.values():
        specs.sort(key=lambda s: s.name)
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
