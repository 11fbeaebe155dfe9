"""Batches as objects on a real Redis with real worker processes: the CLI's submit / kill -9 / resume with
each output line once, cancel, results exactly once across a worker's kill -9, attach by id from another
process. Each tool run appends its index to a file, so the tests count runs, not only what callers got."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker import keys

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).parent / "hermes-gateway")
MARK = "tests.e2e.batchtools:mark"


def _env(home: Any, redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    env.update(HERMES_HOME=str(home.path), HERMES_REDIS_URL=redis_url)
    return env


def _mark_tool(home: Any, concurrency: int, **fields: Any) -> None:
    home.tool("mark", function=MARK, timeout=20, concurrency=concurrency, **fields)


def _runs(path: Path) -> collections.Counter[int]:
    return collections.Counter(int(x) for x in path.read_text().split()) if path.exists() else collections.Counter()


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_cli_submit_killed_with_sigkill_then_resumed_gives_each_line_once_and_runs_each_item_once(
    redis_url: str, home: Any, workers: Any, tmp_path: Path, wait_until: Any
) -> None:
    n = 300
    _mark_tool(home, concurrency=6, queue_size=40)
    marks = tmp_path / "marks"
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"i": i, "path": str(marks), "seconds": 0.03}) + "\n" for i in range(n)))
    out = tmp_path / "out.jsonl"
    workers(1, concurrency=16)
    env = _env(home, redis_url)
    first = subprocess.Popen(
        [CLI, "batch", "submit", "mark", str(items), "--out", str(out), "--window", "60"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert first.stdout is not None
    batch_id = first.stdout.readline().strip()  # printed at once, before any call ends
    assert batch_id and len(_lines(out)) < n
    wait_until(lambda: len(_lines(out)) >= 40, 30, message="the first results written")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    written = len(_lines(out))
    assert written < n, "the submitter was killed before the end"

    status = subprocess.run([CLI, "batch", "status", batch_id, "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    seen = json.loads(status.stdout)
    assert seen["state"] == "submitting" and seen["total"] is None and seen["submitted"] < n

    again = subprocess.run(
        [CLI, "batch", "submit", "--resume", batch_id, str(items), "--out", str(out), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == batch_id
    lines = _lines(out)
    assert sorted(x["index"] for x in lines) == list(range(n))  # each line once: 0 lost, 0 twice
    assert all(x["state"] == "done" and x["result"] == {"i": x["index"], "twice": 2 * x["index"]} for x in lines)
    assert all(x["call_id"].startswith("{tools}.") for x in lines)
    runs = _runs(marks)
    assert sorted(runs) == list(range(n)) and set(runs.values()) == {1}  # no item ran twice

    final = json.loads(subprocess.run([CLI, "batch", "status", batch_id, "--json"], env=env, capture_output=True,
                                      text=True, timeout=60).stdout)
    assert final["state"] == "finished" and final["total"] == n and final["counts"]["done"] == n


def test_cancel_stops_the_submission_and_ends_every_sent_call_once(
    gateway: Any, home: Any, workers: Any, tmp_path: Path, wait_until: Any
) -> None:
    _mark_tool(home, concurrency=4)
    gateway.sync_tools()
    workers(1, concurrency=8)
    marks = tmp_path / "marks"
    job = gateway.batch("mark", ({"i": i, "path": str(marks), "seconds": 0.1} for i in range(400)), window=40)
    wait_until(lambda: job.progress().finished >= 8, 30, message="some calls ended")
    job.cancel()
    p = job.wait(60)
    assert p.complete and p.state == "cancelled"
    assert p.submitted < 400  # the rest was never sent
    results = list(job.results())
    indices = [r.index for r in results]
    assert sorted(indices) == list(range(p.submitted))  # every sent item ended once
    counts = collections.Counter(r.state for r in results)
    assert counts["cancelled"] > 0 and counts["done"] + counts["cancelled"] == p.submitted
    assert counts == collections.Counter({k: v for k, v in p.counts.items() if v})
    runs = _runs(marks)
    assert set(runs.values()) <= {1} and set(runs) <= set(range(p.submitted))
    assert {r.index for r in results if r.state == "done"} <= set(runs)


def test_cancel_after_every_item_ended_leaves_the_batch_finished(
    gateway: Any, home: Any, workers: Any, tmp_path: Path
) -> None:
    _mark_tool(home, concurrency=4)
    gateway.sync_tools()
    workers(1, concurrency=4)
    job = gateway.batch("mark", ({"i": i, "path": str(tmp_path / "marks")} for i in range(5)))
    assert job.wait(60).complete
    assert job.cancel() == 0  # (the README's job.progress(); job.cancel(); job.wait() on a batch that ended)
    p = job.wait(10)
    assert p.to_dict()["state"] == "finished" and p.counts == {"done": 5}
    assert sorted(r.index for r in job.results() if r.state == "done") == list(range(5))


def test_results_hold_each_item_once_across_a_worker_killed_with_sigkill(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path, wait_until: Any
) -> None:
    n = 200
    _mark_tool(home, concurrency=8)
    gateway.sync_tools()
    a, _b = workers(2, concurrency=8, lease=2.0)
    marks = tmp_path / "marks"
    job = gateway.batch("mark", ({"i": i, "path": str(marks), "seconds": 0.05} for i in range(n)), window=100)
    wait_until(lambda: job.progress().finished >= 40, 30, message="40 calls ended")
    held = conn.zcard(keys.leases(keys.tag("tools")))
    a.kill()
    p = job.wait(60)
    assert p.complete and p.counts.get("done") == n, p
    results = list(job.results())
    assert sorted(r.index for r in results) == list(range(n))  # each index once in the output
    assert all(r.result == {"i": r.index, "twice": 2 * r.index} for r in results)
    runs = _runs(marks)
    assert sorted(runs) == list(range(n))  # every item ran
    again = sum(c - 1 for c in runs.values())
    assert again <= held  # only calls in flight on the killed worker ran a second time


def test_a_batch_is_followed_by_id_from_another_process(
    gateway: Any, home: Any, workers: Any, redis_url: str, tmp_path: Path
) -> None:
    _mark_tool(home, concurrency=8)
    gateway.sync_tools()
    workers(1, concurrency=8)
    marks = tmp_path / "marks"
    items: list[Any] = [{"i": i, "path": str(marks)} for i in range(50)]
    items[7] = {"path": str(marks)}  # fails alone in the worker (the function wants `i`)
    items[9] = ["not", "a", "mapping"]  # refused before it is a call: a failed result, the batch goes on
    job = gateway.batch("mark", items)
    env = _env(home, redis_url)
    waited = subprocess.run([CLI, "batch", "wait", job.id], env=env, capture_output=True, text=True, timeout=120)
    assert waited.returncode == 1, waited.stderr  # some items failed
    assert f"batch {job.id}" in waited.stdout
    out = tmp_path / "results.jsonl"
    got = subprocess.run([CLI, "batch", "results", job.id, "--out", str(out)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    lines = {x["index"]: x for x in _lines(out)}
    assert sorted(lines) == list(range(50))
    assert lines[9]["state"] == "failed" and lines[9]["error"]["type"] == "invalid_args"
    assert lines[7]["state"] == "failed" and "error" in lines[7]
    assert all(lines[i]["state"] == "done" for i in range(50) if i not in (7, 9))
    listed = json.loads(subprocess.run([CLI, "batch", "list", "--json"], env=env, capture_output=True, text=True,
                                       timeout=60).stdout)
    assert any(b["id"] == job.id and b["counts"] == {"done": 48, "failed": 2, "cancelled": 0} for b in listed)
    missing = subprocess.run([CLI, "batch", "status", "nosuchbatch"], env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no such batch" in missing.stderr


def test_the_async_client_runs_a_batch_and_attaches_by_id(
    redis_url: str, home: Any, workers: Any, tmp_path: Path
) -> None:
    import asyncio

    from hermes_gateway.aio import AsyncGateway

    _mark_tool(home, concurrency=8)
    workers(1, concurrency=8)
    marks = tmp_path / "marks"

    async def run() -> tuple[list[int], dict[str, Any], dict[str, Any]]:
        async with await AsyncGateway.connect(redis_url, home=str(home.path)) as agw:
            from workers.specs import sync_dir

            await asyncio.to_thread(lambda: sync_dir(agw._threaded().directory, home.tools_dir, []))
            job = await agw.batch("mark", [{"i": i, "path": str(marks)} for i in range(40)], window=10)
            seen = [item.index async for item in job.results()]
            other = await agw.batch_job(job.id)
            return seen, (await other.wait(30)).to_dict(), (await job.progress()).to_dict()

    seen, waited, progress = asyncio.run(run())
    assert sorted(seen) == list(range(40))
    assert waited["complete"] and waited["counts"]["done"] == 40 and progress == {**waited, "rate": progress["rate"]}
