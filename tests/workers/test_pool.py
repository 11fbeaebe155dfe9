"""Worker process set-up: the garbage collector's thresholds."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from broker.errors import ConfigError
from tests.conftest import REPO
from workers.pool import GC_THRESHOLD, tune_gc


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_a_worker_raises_the_young_generation_threshold_by_default() -> None:
    gc.set_threshold(700, 10, 10)
    assert tune_gc({}) == GC_THRESHOLD
    assert gc.get_threshold() == GC_THRESHOLD


def test_the_thresholds_can_be_set_or_left_to_python() -> None:
    gc.set_threshold(700, 10, 10)
    assert tune_gc({"HERMES_GC_THRESHOLD": "default"}) is None
    assert gc.get_threshold() == (700, 10, 10)
    assert tune_gc({"HERMES_GC_THRESHOLD": " 20000,15 "}) == (20000, 15)
    assert gc.get_threshold()[:2] == (20000, 15)


@pytest.mark.parametrize("raw", ["lots", "1,2,3,4", "-5", "10,,2", "0", "off"])
def test_a_bad_threshold_is_a_config_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="HERMES_GC_THRESHOLD"):
        tune_gc({"HERMES_GC_THRESHOLD": raw})


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
