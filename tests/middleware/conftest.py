"""Fixtures for the middleware tests: a registry, a HERMES_HOME, captured structlog output."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from middleware import MiddlewareRegistry


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
    yield hermes_home
    # Plugin modules are imported under hermes_plugins.*; drop them so tests do not share module state.
    for name in [m for m in sys.modules if m == "hermes_plugins" or m.startswith("hermes_plugins.")]:
        del sys.modules[name]
