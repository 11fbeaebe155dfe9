"""Helpers shared by the middleware tests."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plugins"


def write_plugin(home: Path, name: str, source: str, manifest: dict[str, Any] | None = None) -> Path:
    """Create ``$HERMES_HOME/plugins/<name>/`` with a plugin.yaml and the given ``__init__.py`` source."""
    plugin_dir = home / "plugins" / name
    plugin_dir.mkdir(parents=True, exist_ok=True)
    (plugin_dir / "plugin.yaml").write_text(yaml.safe_dump(manifest or {"name": name, "version": "1.0"}))
    (plugin_dir / "__init__.py").write_text(source)
    return plugin_dir


def install_example(home: Path, name: str) -> Path:
    """Copy one of examples/plugins/<name> into ``$HERMES_HOME/plugins``."""
    return Path(shutil.copytree(EXAMPLES / name, home / "plugins" / name))


def warnings_of(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["log_level"] == "warning"]


def debugs_of(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["log_level"] == "debug"]
