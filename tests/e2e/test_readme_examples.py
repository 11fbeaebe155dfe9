"""The README's quick start run as printed: its shell block, with a fresh HOME (so ``~/.hermes`` is new)
and no Redis URL, from a directory that has the repository's ``.venv`` and ``examples``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def readme_block(section: str, lang: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"```{lang}\n(.*?)```", text[text.index(section) :], re.S)
    assert match is not None
    return match.group(1)


@pytest.mark.skipif(shutil.which("bash") is None, reason="the README's shell block is for bash")
def test_the_quick_start_runs_as_printed(tmp_path: Path) -> None:
    work = tmp_path / "checkout"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the `.venv/bin/...` it names
    (work / "examples").symlink_to(ROOT / "examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env["HOME"] = str(tmp_path / "home")
    script = "set -euo pipefail\n" + readme_block("## Quick start: the seed's first tool, exactly", "sh")
    out = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-3:] == ["Hello, Alice!", "Hello, Alice!", "Hello, Bob!"], out.stdout
    assert (tmp_path / "home" / ".hermes" / "tools" / "hello.yaml").exists()
