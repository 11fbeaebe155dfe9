"""The real Hermes agent's virtualenv, made by the README's install and shared by every test that runs it.

``pip install 'hermes-agent[mcp]==0.19.0' hermes-gateway`` (this checkout, editable: the code under test)
into a venv under ``VENV_ROOT``, built once per checkout (under a lock: test runs and xdist workers wait
for one build, not start a second) and kept until pyproject.toml changes. It serves
tests/e2e/test_hermes_agent_plugin.py (the agent with our plugin) and
tests/middleware/test_interop_hermes_agent.py (Hermes' plugin machinery with our example plugins): a
run builds one venv, not two. Hermes loads an entry-point plugin (ours is one) only when ``plugins.enabled``
names it, so our package installed beside the agent changes nothing the interop scripts run unless a test
enables it; the example plugins import nothing of ours.

The venv is keyed by the checkout's path: another clone (a CI run's fresh clone in another folder)
builds its own, while a clone at a path that built one before reuses it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

HERMES_VERSION = "0.19.0"
VENV_ROOT = Path("/tmp/hermes-interop-venv")
# The README's install, with this checkout (editable: the code under test) in place of the name.
DOCUMENTED_INSTALL = [f"hermes-agent[mcp]=={HERMES_VERSION}", "-e", str(REPO)]


def terminal_line(request: pytest.FixtureRequest, line: str) -> None:
    # Shown even under output capture: the install time is part of what these tests report.
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capman is None:
        return
    with capman.global_and_fixture_disabled():
        reporter.write_line(line)


def documented_venv(request: pytest.FixtureRequest) -> Path:
    """The venv of ``pip install 'hermes-agent[mcp]==0.19.0' hermes-gateway`` (this checkout): the agent
    with its mcp extra and our plugin with all its dependencies, resolved together (no ``--no-deps``)."""
    VENV_ROOT.mkdir(parents=True, exist_ok=True)
    tag = hashlib.sha256(str(REPO).encode()).hexdigest()[:10]
    venv = VENV_ROOT / f"{HERMES_VERSION}-documented-{tag}"
    stamp = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + repr(DOCUMENTED_INSTALL).encode()).hexdigest()[:16]
    marker = venv / ".hermes-gateway-documented"
    with open(VENV_ROOT / f"{HERMES_VERSION}-documented-{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text()).get("stamp") == stamp:
            took = json.loads(marker.read_text())["install_s"]
            terminal_line(request, f"hermes-agent[mcp] + hermes-gateway venv: cached {venv} (install took {took:.1f}s)")
            return venv
        shutil.rmtree(venv, ignore_errors=True)  # a half-built or outdated venv
        started = time.monotonic()
        base = Path(getattr(sys, "_base_executable", sys.executable))
        python = str(venv / "bin" / "python")
        for step in (
            [str(base), "-m", "venv", str(venv)],
            [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *DOCUMENTED_INSTALL],
        ):
            proc = subprocess.run(step, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, f"{' '.join(step)} failed:\n{proc.stderr[-3000:]}"
        took = time.monotonic() - started
        marker.write_text(json.dumps({"stamp": stamp, "install_s": took}))
        terminal_line(request, f"pip install 'hermes-agent[mcp]=={HERMES_VERSION}' hermes-gateway: {took:.1f}s")
        return venv
