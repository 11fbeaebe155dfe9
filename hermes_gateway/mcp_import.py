"""``mcp add``: an MCP server's tools become ``mcp`` tools in the directory, one report line each."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from broker.directory import Directory
from broker.errors import InvalidSpec
from broker.toolspec import ToolSpec
from workers.executors.mcp import list_server_tools


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
) -> list[Imported]:
    """List the server's tools and register each (named ``prefix + tool``); raises when it is unreachable.

    ``write_dir`` also writes each spec to ``<write_dir>/<name>.yaml`` (for an embedded broker, whose
    directory ends with the command).
    """
    listing = dict(server)
    if not _stderr_is_a_file():
        listing["stderr"] = "discard"  # the SDK hands the server our stderr, which must be a real file
    out = []
    for found in list_server_tools(listing, handshake_timeout=handshake_timeout):
        data = {**found, "name": f"{prefix}{found['name']}", "mcp": server}
        try:
            spec = ToolSpec.from_dict(data)
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


def _stderr_is_a_file() -> bool:
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True
