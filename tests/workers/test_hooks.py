"""Per-call hooks (workers/hooks.py): run by the runner in table order, after-hooks in reverse and contained;
the call's log lines at each level."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from broker import logs
from broker.config import Settings, WorkerSettings
from broker.directory import Directory
from broker.errors import PermissionDenied
from broker.toolspec import ToolSpec
from tests.workers.test_worker import TOOLS, TRACE, run_all, states, submit
from workers.hooks import Hook
from workers.runner import HOOKS, Running, WorkerCore
from workers.specs import check_spec


@pytest.fixture
def core(fake: Any, tmp_path: Path) -> Iterator[WorkerCore]:
    for spec in TOOLS:
        Directory(fake).register(check_spec(spec))
    c = WorkerCore(fake, Settings(home=tmp_path, workers=WorkerSettings(lease=5.0, result_ttl=600)), "w-test")
    yield c
    c.close()


@pytest.fixture
def lines() -> Iterator[Any]:
    """Configure the worker's logging at a level into a buffer; the JSON lines written meanwhile."""
    saved, root = (logs._level, logs._json, logs._calls), logging.getLogger()
    handlers, stream = root.handlers[:], io.StringIO()
    root.handlers = []

    def at(level: str) -> io.StringIO:
        logs.configure(level, "json", stream=stream)
        return stream

    try:
        yield at
    finally:
        root.handlers = handlers
        structlog.reset_defaults()
        logs._level, logs._json, logs._calls = saved


def _events(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(x) for x in stream.getvalue().splitlines()]


def test_at_info_a_call_writes_only_its_finished_line_with_its_ids(fake: Any, core: WorkerCore, lines: Any) -> None:
    stream = lines("INFO")
    submit(fake, "c1")
    run_all(core)
    [finished] = [x for x in _events(stream) if x.get("call_id") == "c1"]
    assert finished["event"] == "call finished" and finished["level"] == "info" and finished["state"] == "done"
    assert finished["trace_id"] == TRACE and finished["tool"] == "echo"


def test_at_debug_the_started_line_is_written_too(fake: Any, core: WorkerCore, lines: Any) -> None:
    stream = lines("DEBUG")
    submit(fake, "c1")
    run_all(core)
    events = [x["event"] for x in _events(stream) if x.get("call_id") == "c1"]
    assert events == ["call started", "call finished"]


def test_a_failed_call_logs_a_warning_with_its_ids_even_at_warning(fake: Any, core: WorkerCore, lines: Any) -> None:
    stream = lines("WARNING")
    submit(fake, "c1", tool="nope")
    run_all(core)
    [failed] = [x for x in _events(stream) if x.get("call_id") == "c1"]
    assert (failed["event"], failed["level"], failed["error_type"]) == ("call finished", "warning", "unknown_tool")
    assert failed["trace_id"] == TRACE


SEEN: list[str] = []


class Outer(Hook):
    def before_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        SEEN.append("outer before")

    def after_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        SEEN.append("outer after")
        raise RuntimeError("a broken hook")


class Inner(Hook):
    def before_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        SEEN.append("inner before")

    def after_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None) -> None:
        SEEN.append(f"inner after {args}")


def test_hooks_run_in_table_order_after_hooks_in_reverse_and_a_failing_one_changes_nothing(
    fake: Any, core: WorkerCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("workers.runner.HOOKS", [*HOOKS, Outer, Inner])
    SEEN.clear()
    submit(fake, "c1", x=1)
    run_all(core)
    assert SEEN == ["outer before", "inner before", "inner after {'x': 1}", "outer after"]
    assert states(fake, "c1") == ["pending", "routing", "executing", "formatting", "done"]


class Refuse(Hook):
    def before_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        raise PermissionDenied("not today")


def test_a_before_hook_that_raises_refuses_the_call_before_its_executor(
    fake: Any, core: WorkerCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("workers.runner.HOOKS", [*HOOKS, Refuse, Inner])
    SEEN.clear()
    submit(fake, "c1")
    run_all(core)
    assert states(fake, "c1") == ["pending", "routing", "failed"] and SEEN == []
    assert core.calls.record("c1")["error"]["type"] == "permission_denied"


def test_the_circuit_hook_makes_a_specs_breaker_config_once_and_anew_for_a_new_version(core: WorkerCore) -> None:
    from workers.hooks import Circuit

    circuit = Circuit(core)
    guarded = check_spec({**TOOLS[0], "breaker": {"failures": 3}})
    first = circuit.config(guarded)
    assert first is not None and first.key == f"tool:{guarded.name}" and circuit.config(guarded) is first
    changed = check_spec({**TOOLS[0], "breaker": {"failures": 7}})  # (a new version: a new spec object)
    second = circuit.config(changed)
    assert second is not None and second is not first and second != first
    assert circuit.config(check_spec(TOOLS[0])) is None  # no breaker asked for
