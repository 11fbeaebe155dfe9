"""bench/shortcuts.py still runs, small, against the test Redis (its figures are measured in full, never
asserted here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.test_benches import bench

pytestmark = pytest.mark.e2e


def test_shortcuts_runs_each_shortcut_both_ways_and_writes_its_json(redis_url: str, tmp_path: Path) -> None:
    out = tmp_path / "shortcuts.json"
    small = ("--rounds", "2", "--seconds", "0.02", "--e2e-calls", "200", "--e2e-rounds", "1")
    lines = bench("shortcuts.py", "--url", redis_url, *small, "--out", str(out))
    assert re.fullmatch(r"shortcuts_ratio=\d+\.\d{3}", lines[-1])
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"threads", "quickcheck", "frozen", "redaction", "pipes", "claim", "lean_spans"}
    assert all(len(row["rounds"]) == 2 and row["on_us"] > 0 and row["off_us"] > 0 for row in result["rows"].values())
    assert result["load_average"]["before"] and result["commit"] is not None
    assert result["end_to_end"]["on_calls_per_s"] > 0 and result["end_to_end"]["off_worker_us"] > 0
