"""Worker process set-up: the garbage collector's thresholds."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.config import GC_THRESHOLD, load_settings
from broker.errors import ConfigError
from tests.conftest import REPO
from workers.pool import tune_gc


def threshold(environ: dict[str, str], home: Path) -> tuple[int, ...] | None:
    """What a worker's settings say, with ``environ`` as its environment."""
    return load_settings(home, environ=environ).workers.gc_threshold


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_a_worker_raises_the_young_generation_threshold_by_default(tmp_path: Path) -> None:
    gc.set_threshold(700, 10, 10)
    assert tune_gc(threshold({}, tmp_path)) == GC_THRESHOLD
    assert gc.get_threshold() == GC_THRESHOLD


def test_the_thresholds_can_be_set_or_left_to_python(tmp_path: Path) -> None:
    gc.set_threshold(700, 10, 10)
    assert tune_gc(threshold({"HERMES_GC_THRESHOLD": "default"}, tmp_path)) is None
    assert gc.get_threshold() == (700, 10, 10)
    assert tune_gc(threshold({"HERMES_GC_THRESHOLD": " 20000,15 "}, tmp_path)) == (20000, 15)
    assert gc.get_threshold()[:2] == (20000, 15)


@pytest.mark.parametrize("raw", ["lots", "1,2,3,4", "-5", "10,,2", "0", "off"])
def test_a_bad_threshold_is_a_config_error_naming_the_variable(raw: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="HERMES_GC_THRESHOLD"):
        threshold({"HERMES_GC_THRESHOLD": raw}, tmp_path)


def test_a_worker_started_with_a_bad_threshold_says_why_and_exits_2(redis_url: str) -> None:
    env = {"HERMES_REDIS_URL": redis_url, "HERMES_GC_THRESHOLD": "lots", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "workers", "--queues", "tools"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "HERMES_GC_THRESHOLD" in proc.stderr


@pytest.mark.parametrize("processes", ["1", "3"])
def test_the_worker_command_reports_a_bad_threshold_once_without_a_traceback(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, processes: str
) -> None:
    from click.testing import CliRunner

    from hermes_gateway.cli import main

    monkeypatch.setenv("HERMES_REDIS_URL", redis_url)
    monkeypatch.setenv("HERMES_GC_THRESHOLD", "0")
    result = CliRunner().invoke(main, ["worker", "--processes", processes, "--queues", "tools"])
    assert result.exit_code == 2
    assert "error: HERMES_GC_THRESHOLD" in result.output and "Traceback" not in result.output
