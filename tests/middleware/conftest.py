"""Fixtures for the middleware tests: a registry, a HERMES_HOME, captured structlog output."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from middleware import MiddlewareRegistry
from middleware.manifest import ENTRY_POINTS_GROUP


@pytest.fixture
def registry() -> MiddlewareRegistry:
    return MiddlewareRegistry()


@pytest.fixture
def logs() -> Iterator[list[dict[str, Any]]]:
    with structlog.testing.capture_logs() as captured:
        yield captured


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An isolated HERMES_HOME; HOME points inside it too so nothing touches the real ~/.hermes."""
    hermes_home = tmp_path / "hermes-home"
    (hermes_home / "plugins").mkdir(parents=True)
    monkeypatch.setenv("HERMES_HOME", str(hermes_home))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    # Discovery sees only the plugins a test installs: those of installed distributions (ours declares
    # ``hermes-gateway`` for the Hermes agent) are hidden; ``fake_entry_points`` adds its own on top.
    real = importlib.metadata.entry_points

    def entry_points(**params: Any) -> Any:
        return [] if params.get("group") == ENTRY_POINTS_GROUP else real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    yield hermes_home
    # Plugin modules are imported under hermes_plugins.*; drop them so tests do not share module state.
    for name in [m for m in sys.modules if m == "hermes_plugins" or m.startswith("hermes_plugins.")]:
        del sys.modules[name]
