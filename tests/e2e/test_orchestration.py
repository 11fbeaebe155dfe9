"""Flows on real workers: serial steps fed by reference, conditions, parallel and for-each fan-out with
failures per item, breaker fallback, and ``hermes-gateway flow run`` showing steps live."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker import events
from hermes_gateway.flow import Flow, StepEvent, run_flow
from tests.conftest import REPO
from tests.e2e.flowtools import lines

pytestmark = pytest.mark.e2e

BACKEND = "tests.e2e.flowtools:backend"


def _tools(home: Any, tmp: Path, **breaker: Any) -> tuple[Path, Path]:
    home.echo_tool()
    mode, log = tmp / "mode", tmp / "backend.log"
    mode.write_text("fail")
    home.tool(
        "fragile",
        function=BACKEND,
        timeout=10,
        concurrency=10,
        breaker=breaker,
        input_schema={"type": "object"},
    )
    return mode, log


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``hermes-gateway ARGS`` in a process of its own, with ``env``."""
    cli = str(Path(sys.executable).parent / "hermes-gateway")
    return subprocess.run([cli, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_serial_steps_pass_results_by_reference_and_conditions_skip_steps(
    gateway: Any, home: Any, workers: Any, conn: Any, tmp_path: Path
) -> None:
    _tools(home, tmp_path)
    gateway.sync_tools()
    workers(1)
    flow = (
        Flow("trip")
        .step("lookup", "echo", {"city": "{{ args.city }}", "people": "{{ args.n }}", "tags": ["a", "b"]})
        .step(
            "weather",
            "echo",
            {
                "city": "{{ steps.lookup.result.city }}",
                "line": "{{ steps.lookup.result.city }} x{{ args.n }}",
            },
            when="steps.lookup.result.people > 1 and 'a' in steps.lookup.result.tags",
        )
        .step("abroad", "echo", {"never": True}, when="steps.lookup.result.city != 'Paris'")
        .step("after", "echo", {"skipped": "{{ steps.abroad.state }}", "got": "{{ steps.abroad.result }}"})
    )
    seen: list[StepEvent] = []
    out = run_flow(gateway, flow, {"city": "Paris", "n": 2}, on_event=seen.append, session_id="s-flow")
    assert out.state == "done", out.error
    assert out.steps["lookup"].result == {"city": "Paris", "people": 2, "tags": ["a", "b"]}  # types kept
    assert out.steps["weather"].result == {"city": "Paris", "line": "Paris x2"}
    assert out.steps["abroad"].state == "skipped" and out.steps["abroad"].call_id is None
    assert out.steps["after"].result == {"skipped": "skipped", "got": None}
    assert out.result["weather"] == {"city": "Paris", "line": "Paris x2"}
    # Every step was an ordinary call, reported live with its own states, carrying the flow's context.
    lookup_states = [
        e.detail.get("call_state") for e in seen if e.step == "lookup" and "call_state" in e.detail
    ]
    assert lookup_states == ["pending", "routing", "executing", "formatting"]
    assert [e.state for e in seen if e.step == "weather"][-1] == "done"
    first = events.history(conn, out.steps["lookup"].call_id)[0]
    assert first.session_id == "s-flow"

    # A failed step stops a flow; on_error: continue lets it go on.
    doc = {
        "name": "stops",
        "steps": [
            {
                "id": "bad",
                "tool": "fragile",
                "args": {"mode_file": str(tmp_path / "mode"), "log": str(tmp_path / "l")},
            },
            {"id": "next", "tool": "echo", "args": {"x": 1}},
        ],
    }
    stopped = run_flow(gateway, doc)
    assert stopped.state == "failed" and stopped.error["step"] == "bad"
    assert stopped.error["type"] == "executor_error" and stopped.steps["next"].state == "pending"
    doc["steps"][0]["on_error"] = "continue"
    went_on = run_flow(gateway, doc)
    assert went_on.state == "done" and went_on.steps["next"].result == {"x": 1}


def test_parallel_and_for_each_fan_out_with_one_combined_result_and_failures_per_item(
    gateway: Any, home: Any, workers: Any, tmp_path: Path
) -> None:
    mode, log = _tools(home, tmp_path)
    ok_mode = tmp_path / "ok"
    ok_mode.write_text("ok")
    gateway.sync_tools()
    workers(2, concurrency=8)
    doc = {
        "name": "fan",
        "steps": [
            {
                "id": "fan",
                "on_error": "continue",
                "parallel": [
                    {"id": "a", "tool": "echo", "args": {"v": "{{ args.v }}"}},
                    {
                        "id": "b",
                        "tool": "fragile",
                        "args": {"mode_file": str(mode), "log": str(log), "tag": "b"},
                    },
                    {
                        "id": "c",
                        "steps": [
                            {"id": "c1", "tool": "echo", "args": {"w": 2}},
                            {"id": "c2", "tool": "echo", "args": {"w": "{{ steps.c1.result.w }}"}},
                        ],
                    },
                ],
            },
            {
                "id": "each",
                "for_each": "args.items",
                "as": "it",
                "tool": "fragile",
                "args": {"mode_file": "{{ it.mode }}", "log": str(log), "tag": "{{ it.tag }}"},
                "on_error": "continue",
            },
            {
                "id": "summary",
                "tool": "echo",
                "args": {"failed": "{{ steps.each.items[1].ok }}", "fan": "{{ steps.fan.state }}"},
            },
        ],
    }
    items = [
        {"mode": str(ok_mode), "tag": "x"},
        {"mode": str(mode), "tag": "y"},
        {"mode": str(ok_mode), "tag": "z"},
    ]
    out = run_flow(gateway, doc, {"v": 7, "items": items})
    assert out.state == "done", out.error
    fan = out.steps["fan"]
    assert fan.state == "partial"
    assert fan.result["a"] == {"v": 7} and fan.result["c"] == {"c1": {"w": 2}, "c2": {"w": 2}}
    assert [(i["id"], i["ok"]) for i in fan.items] == [("a", True), ("b", False), ("c", True)]
    assert fan.items[1]["error"]["type"] == "executor_error"
    each = out.steps["each"]
    assert each.state == "partial" and each.error["failed"] == 1
    assert each.result == [{"ok": True, "tag": "x"}, None, {"ok": True, "tag": "z"}]
    assert [i["ok"] for i in each.items] == [True, False, True]
    assert out.steps["summary"].result == {"failed": False, "fan": "partial"}
    assert sorted(line.split()[1] for line in lines(log)) == ["b", "x", "y", "z"]

    # Without on_error: continue, a failed branch or item fails its step, and the flow stops there.
    for fan in doc["steps"][:2]:
        del fan["on_error"]
    fan_stops = run_flow(gateway, doc, {"v": 7, "items": items})
    assert fan_stops.state == "failed" and fan_stops.steps["fan"].state == "failed"
    assert fan_stops.error == {"step": "fan", "type": "partial_failure", "failed": 1,
                               "message": "1 of 3 failed; first b: executor_error: RuntimeError: back end is down"}
    assert fan_stops.steps["fan"].result["a"] == {"v": 7} and fan_stops.steps["each"].state == "pending"
    doc["steps"] = [doc["steps"][1], {"id": "after", "tool": "echo", "args": {}}]
    each_stops = run_flow(gateway, doc, {"v": 7, "items": items})
    assert each_stops.state == "failed" and each_stops.steps["each"].state == "failed"
    assert each_stops.error["step"] == "each" and each_stops.error["message"].startswith("1 of 3 failed; first item 1:")
    assert each_stops.steps["after"].state == "pending"


def test_an_open_breaker_takes_the_fallback_or_skips_and_the_cli_shows_steps_live(
    gateway: Any, home: Any, workers: Any, redis_url: str, tmp_path: Path
) -> None:
    mode, log = _tools(home, tmp_path, failures=1, cooldown=60)
    gateway.sync_tools()
    workers(1)
    backend = {"mode_file": str(mode), "log": str(log)}
    with pytest.raises(Exception):  # noqa: B017 - one failure opens this breaker
        gateway.call_tool("fragile", {**backend, "tag": "trip"}).result(10)
    flow = {
        "name": "degraded",
        "steps": [
            {
                "id": "main",
                "tool": "fragile",
                "args": {**backend, "tag": "main"},
                "fallback": {"tool": "echo", "args": {"from": "fallback", "city": "{{ args.city }}"}},
            },
            {"id": "optional", "tool": "fragile", "args": {**backend, "tag": "opt"}, "fallback": "skip"},
            {
                "id": "final",
                "tool": "echo",
                "args": {"main": "{{ steps.main.result.from }}", "opt": "{{ steps.optional.state }}"},
            },
        ],
        "result": "{{ steps.final.result }}",
    }
    path = tmp_path / "flow.yaml"
    path.write_text(yaml.safe_dump(flow))
    out = run_flow(gateway, path, {"city": "Oslo"})
    assert out.steps["main"].state == "fallback" and out.steps["main"].result == {
        "from": "fallback",
        "city": "Oslo",
    }
    assert out.steps["optional"].state == "skipped" and out.steps["optional"].reason == "breaker open"
    assert out.result == {"main": "fallback", "opt": "skipped"}
    assert [line.split()[1] for line in lines(log)] == [
        "trip"
    ]  # the open breaker kept the back end untouched

    env = dict(os.environ, HERMES_REDIS_URL=redis_url, HERMES_HOME=str(home.path))
    cli = _cli(env, "flow", "run", str(path), "--args", '{"city": "Rome"}')
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == {"main": "fallback", "opt": "skipped"}
    shown = cli.stderr.splitlines()
    assert any(" main " in line and "fallback" in line for line in shown)
    assert any(" optional " in line and "skipped" in line for line in shown)
    assert any(" final " in line and "executing" in line for line in shown)
    assert "flow degraded: done" in cli.stderr


FAN_STEPS = {
    "for_each": {"id": "fan", "for_each": "args.items", "tool": "nap", "args": {"seconds": "{{ item }}"}},
    "parallel": {"id": "fan", "parallel": [  # (its branches wait on their calls in threads of their own)
        {"id": "a", "tool": "nap", "args": {"seconds": "{{ args.items[0] }}"}},
        {"id": "b", "tool": "nap", "args": {"seconds": "{{ args.items[1] }}"}},
    ]},
}  # fmt: skip


@pytest.mark.parametrize("fan", ["for_each", "parallel"])
def test_ctrl_c_on_flow_run_cancels_the_calls_it_waits_on(
    gateway: Any, home: Any, workers: Any, redis_url: str, tmp_path: Path, wait_until: Any, fan: str
) -> None:
    import signal
    import time

    from broker import keys
    from tests.conftest import sigint_as_by_default

    home.sleep_tool("nap")
    gateway.sync_tools()
    workers(1)
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump({"name": "slow", "steps": [FAN_STEPS[fan]]}))
    env = dict(os.environ, HERMES_REDIS_URL=redis_url, HERMES_HOME=str(home.path))
    run = subprocess.Popen(
        [str(Path(sys.executable).parent / "hermes-gateway"), "flow", "run", str(path), "--args", "{items: [30, 30]}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_by_default,
    )  # fmt: skip
    try:
        leased = wait_until(lambda: len(ids := gateway.conn.zrange(keys.leases(keys.tag("tools")), 0, -1)) == 2 and ids,
                            30, message="both calls to run")  # fmt: skip
        run.send_signal(signal.SIGINT)  # Ctrl-C while the step waits on its calls
        t0 = time.monotonic()
        _out, err = run.communicate(timeout=30)
        assert time.monotonic() - t0 < 10, "the command waited for its 30 s calls to end"
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130 and "interrupted: its running calls were cancelled" in err, err
    for call_id in (c.decode() for c in leased):
        ended = wait_until(lambda c=call_id: [e for e in events.history(gateway.conn, c) if e.terminal], 15)
        assert ended[-1].state == "cancelled", call_id


def test_a_failed_flow_names_the_step_that_stopped_it_and_a_call_past_the_wait_is_cancelled(
    gateway: Any, home: Any, workers: Any, tmp_path: Path, wait_until: Any
) -> None:
    import time

    mode, log = _tools(home, tmp_path)
    home.sleep_tool("nap")
    gateway.sync_tools()
    workers(1, concurrency=8)
    backend = {"mode_file": str(mode), "log": str(log)}
    doc = {"name": "stops", "steps": [
        {"id": "fan", "on_error": "continue", "parallel": [
            {"id": "a", "tool": "echo", "args": {}},
            {"id": "g", "steps": [{"id": "b", "tool": "fragile", "args": {**backend, "tag": "b"}}]}]},
        {"id": "later", "tool": "fragile", "args": {**backend, "tag": "later"}},
    ]}  # fmt: skip
    out = run_flow(gateway, doc, {})
    assert out.state == "failed" and out.steps["fan"].state == "partial"
    assert out.error["step"] == "later" and out.error["type"] == "executor_error"  # (not the partial fan's b)
    grouped = run_flow(gateway, {"name": "g", "steps": [
        {"id": "g", "on_error": "continue", "steps": [{"id": "inner", "tool": "fragile", "args": backend}]},
        {"id": "last", "tool": "fragile", "args": backend},
    ]}, {})  # fmt: skip
    assert grouped.error["step"] == "last"  # (the group's inner failure was let go by on_error: continue)

    t0 = time.monotonic()
    slow = run_flow(
        gateway, {"name": "slow", "steps": [{"id": "nap", "tool": "nap", "args": {"seconds": 20}}]}, wait=1.0
    )
    assert time.monotonic() - t0 < 1.8  # one deadline for the call's events and its result
    assert slow.state == "failed" and slow.error == {**slow.error, "step": "nap", "type": "timeout"}
    call_id = slow.steps["nap"].call_id
    ended = wait_until(lambda: [e for e in events.history(gateway.conn, call_id) if e.terminal], 10)
    assert ended[-1].state == "cancelled"  # the flow gave up on it: it must not finish later


def test_for_each_items_the_breaker_refuses_take_the_fallback_with_the_item_in_scope(
    gateway: Any, home: Any, workers: Any, tmp_path: Path
) -> None:
    mode, log = _tools(home, tmp_path, failures=2, cooldown=60)
    gateway.sync_tools()
    workers(1, concurrency=1)  # (one at a time: the first two failures open the breaker for the rest)
    backend = {"mode_file": str(mode), "log": str(log)}
    each = {
        "id": "each",
        "for_each": "args.items",
        "as": "it",
        "tool": "fragile",
        "args": {**backend, "tag": "{{ it }}"},
    }
    skipped = run_flow(
        gateway, {"name": "s", "steps": [{**each, "fallback": "skip"}]}, {"items": list("abcdef")}
    )
    items = skipped.steps["each"].items
    assert [i["ok"] for i in items[:2]] == [False, False]  # they failed and opened the breaker
    assert all(i["ok"] and i["skipped"] == "breaker open" for i in items[2:]), items
    assert sorted(line.split()[1] for line in lines(log)) == ["a", "b"]  # the back end saw no more
    fallback = {"tool": "echo", "args": {"degraded": True, "city": "{{ it }}"}}
    degraded = run_flow(
        gateway, {"name": "f", "steps": [{**each, "fallback": fallback}]}, {"items": ["x", "y"]}
    )
    assert degraded.steps["each"].result == [{"degraded": True, "city": "x"}, {"degraded": True, "city": "y"}]


def test_a_flow_naming_a_tool_not_in_the_directory_or_a_later_step_is_refused_before_any_call(
    gateway: Any, home: Any, workers: Any, redis_url: str, tmp_path: Path
) -> None:
    from broker.errors import UnknownTool

    mode, log = _tools(home, tmp_path)
    mode.write_text("ok")
    gateway.sync_tools()
    workers(1)
    first = {"id": "first", "tool": "fragile", "args": {"mode_file": str(mode), "log": str(log)}}
    doc = {"name": "typo", "steps": [first, {"id": "later", "tool": "echo", "args": {}, "fallback": {"tool": "ecko"}}]}
    with pytest.raises(UnknownTool, match="step later: unknown tool 'ecko': it is not in the tool directory"):
        run_flow(gateway, doc, {})
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(doc))
    forward = tmp_path / "forward.yaml"
    forward.write_text(yaml.safe_dump({"name": "fwd", "steps": [{**first, "args": "{{ steps.later.result }}"},
                                                                {"id": "later", "tool": "echo"}]}))
    env = dict(os.environ, HERMES_REDIS_URL=redis_url, HERMES_HOME=str(home.path))
    for args in (("check", str(path)), ("run", str(path)), ("check", str(forward)), ("run", str(forward))):
        refused = _cli(env, "flow", *args)
        assert refused.returncode == 2 and refused.stdout == "", refused.stderr
        assert "step later: unknown tool 'ecko'" in refused.stderr or "step 'later' has not run yet" in refused.stderr
    assert lines(log) == []  # nothing ran: not even the first step
    # With no broker (HERMES_REDIS_URL unset, no serve running) `flow run` would have $HERMES_HOME/tools alone:
    # those are checked. A broker named but not answering: the rest is checked, and the tools said unchecked.
    del env["HERMES_REDIS_URL"]
    assert "unknown tool 'ecko'" in _cli(env, "flow", "check", str(path)).stderr
    doc["steps"][1]["fallback"] = {"tool": "echo"}
    path.write_text(yaml.safe_dump(doc))
    assert _cli(env, "flow", "check", str(path)).stdout == "typo: ok (2 steps)\n"
    unreachable = _cli({**env, "HERMES_REDIS_URL": "redis://127.0.0.1:1/0"}, "flow", "check", str(path))
    assert unreachable.returncode == 0 and unreachable.stdout == "typo: ok (2 steps; tools not checked)\n"
    assert "warning: tools not checked: cannot reach Redis at redis://127.0.0.1:1/0" in unreachable.stderr


def test_a_for_each_whose_calls_are_refused_as_a_whole_fails_its_step_not_the_run_nor_its_siblings(
    gateway: Any, home: Any, workers: Any
) -> None:
    home.echo_tool()
    home.sleep_tool("nap")
    gateway.sync_tools()
    workers(1)
    each = {"id": "each", "for_each": "args.items", "as": "it", "tool": "echo", "args": "{{ it }}"}  # (not a mapping)
    doc = {"name": "bad", "steps": [
        {"id": "p", "on_error": "continue", "parallel": [each, {"id": "nap", "tool": "nap", "args": {"seconds": 0.5}}]},
        {"id": "after", "tool": "echo", "args": {"went": "on"}},
    ]}  # fmt: skip
    out = run_flow(gateway, doc, {"items": ["a", "b"]})
    assert out.state == "done", out.error
    assert out.steps["each"].state == "failed" and out.steps["each"].error == {
        **out.steps["each"].error, "type": "invalid_args", "message": "arguments for 'echo' must be a mapping, got str"}
    assert out.steps["nap"].state == "done" and out.steps["p"].state == "partial"  # (its sibling was not cancelled)
    assert out.steps["after"].result == {"went": "on"}


def test_for_each_fallback_calls_share_the_step_deadline_and_are_cancelled_past_it(
    gateway: Any, home: Any, workers: Any, tmp_path: Path, wait_until: Any
) -> None:
    import time

    mode, log = _tools(home, tmp_path, failures=1, cooldown=60)
    home.sleep_tool("nap")
    gateway.sync_tools()
    workers(1, concurrency=1)  # (one at a time: the first item's failure opens the breaker for the others)
    each = {"id": "each", "for_each": "args.items", "as": "it", "tool": "fragile",
            "args": {"mode_file": str(mode), "log": str(log), "tag": "{{ it }}"},
            "fallback": {"tool": "nap", "args": {"seconds": 5}}}  # fmt: skip
    t0 = time.monotonic()
    out = run_flow(gateway, {"name": "f", "steps": [each]}, {"items": ["a", "b", "c"]}, wait=1.5)
    assert time.monotonic() - t0 < 2.5  # one deadline for the step, not one more per fallback call
    late = [i["error"]["details"]["call_id"] for i in out.steps["each"].items[1:]]
    assert [i["error"]["type"] for i in out.steps["each"].items] == ["executor_error", "timeout", "timeout"]
    for call_id in late:  # the flow gave up on them: they must not finish later
        ended = wait_until(lambda c=call_id: [e for e in events.history(gateway.conn, c) if e.terminal], 10)
        assert ended[-1].state == "cancelled", call_id
