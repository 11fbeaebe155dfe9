"""``hermes-gateway audit list|show|replay|export`` on calls run by a real worker, and replay planning."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import click
import pytest
import structlog
from click.testing import CliRunner

from broker.audit import AuditLog, AuditRecord
from broker.errors import CallFailed, PermissionDenied, ReplayRefused
from broker.logs import hash_value, keyed_hash
from hermes_gateway import replay
from hermes_gateway.cli import main
from hermes_gateway.cli.audit_cmd import parse_when
from tests.conftest import ECHO, Home, wait_until
from tests.llm_server import LLMServer

KEY = "sk-audit-cli-0123456789abcdefghij"
MODEL = "hermes-test"


def run_cli(redis_url: str, home: Home, *args: str, code: int = 0) -> str:
    """``hermes-gateway ARGS`` in this process; stdout when the exit code is as expected."""
    env = {"HERMES_REDIS_URL": redis_url, "HERMES_HOME": str(home.path)}
    try:
        out = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    finally:
        structlog.reset_defaults()  # the command configured logging onto the runner's stream
    assert out.exit_code == code, out.output
    return out.stdout if code == 0 else out.output


@pytest.fixture
def llm(home: Home) -> Iterator[LLMServer]:
    with LLMServer(api_key=KEY, model=MODEL) as server:
        yield server


@pytest.fixture
def stack(home: Home, llm: LLMServer, gateway: Any, workers: Any, tmp_path: Path) -> Any:
    """Tools (one with a sensitive arg, one that reads a file), the LLM server, and one worker."""
    home.config(
        {
            "model": {"provider": "openai-compatible", "base_url": llm.base_url, "api_key": "${LLM_KEY}"},
            "policy": {"principals": {"agent-a": {"grants": ["net"]}}},
        }
    )
    home.tool("login", function=ECHO, timeout=10, sensitive=["password"], permissions=["net"])
    home.tool(
        "cat",
        executor="command",
        command=[sys.executable, "-c", "import sys; print(open(sys.argv[1]).read().strip())", "{{path}}"],
        input_schema={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        timeout=10,
    )
    gateway.sync_tools()
    workers(1, queues="tools,llm", env={"LLM_KEY": KEY})
    return gateway


def test_list_filters_by_tool_principal_state_and_since(stack: Any, home: Home, redis_url: str) -> None:
    gw = stack
    gw.call_tool("login", {"user": "bob", "password": "pw1"}, principal="agent-a").result(20)
    with pytest.raises(PermissionDenied):
        gw.call_tool("login", {"user": "eve", "password": "pw2"}, principal="agent-b").result(20)
    # Both records are in the stream and the clock has passed the millisecond of the newer one's entry id (what
    # --since compares), so `later` falls after them and before the next call's.
    audit = AuditLog(gw.conn)
    wait_until(lambda: len(audit) == 2, timeout=10, message="the first two calls' audit records")
    newest_ms = int(gw.conn.xrevrange(audit.key, count=1)[0][0].split(b"-")[0])
    wait_until(lambda: time.time() * 1000 >= newest_ms + 1, timeout=5, interval=0.001, message="a later millisecond")
    later = time.time()
    with pytest.raises(CallFailed):
        gw.call_tool("cat", {"path": "/nonexistent/file"}).result(20)

    every = run_cli(redis_url, home, "audit", "list").splitlines()
    assert len(every) == 3 and "cat" in every[0]  # newest first
    by_principal = run_cli(redis_url, home, "audit", "list", "--principal", "agent-a", "--json").splitlines()
    assert [json.loads(line)["args"]["user"] for line in by_principal] == ["bob"]
    failed = run_cli(redis_url, home, "audit", "list", "--tool", "login", "--state", "failed").splitlines()
    assert len(failed) == 1 and "agent-b" in failed[0] and "permission_denied" in failed[0]
    recent = run_cli(redis_url, home, "audit", "list", "--since", str(later), "--json").splitlines()
    assert [json.loads(line)["tool_name"] for line in recent] == ["cat"]
    assert run_cli(redis_url, home, "audit", "list", "--since", "1h", "-n", "2").count("\n") == 2


def test_show_prints_the_record_the_event_history_and_the_llm_call_that_asked(
    stack: Any, home: Home, redis_url: str
) -> None:
    gw = stack
    ask = gw.call_llm({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.2, "model": MODEL})
    ask.result(20)
    tool = gw.call_tool(
        "login", {"user": "bob", "password": "pw1"}, principal="agent-a", parent_call_id=ask.call_id
    )
    tool.result(20)

    out = run_cli(redis_url, home, "audit", "show", tool.call_id)
    assert f"audit record of {tool.call_id}" in out and "state: done" in out and "principal: agent-a" in out
    assert "pw1" not in out and AuditLog(gw.conn).digest("pw1") in out and hash_value("pw1") not in out
    # An ended call keeps its terminal event alone (the history is trimmed when it ends).
    assert out.split("events (")[1].startswith("1):") and " done " in out.split("events (")[1]
    assert f"asked for by LLM call {ask.call_id}:" in out and "temperature" in out

    doc = json.loads(run_cli(redis_url, home, "audit", "show", ask.call_id, "--json"))
    assert doc["record"]["kind"] == "llm" and doc["record"]["model_params"]["temperature"] == 0.2
    assert [e["state"] for e in doc["events"] if e["type"] == "transition"][-1] == "done"
    assert "unknown" in run_cli(redis_url, home, "audit", "show", "nope", code=1)


def test_replay_of_a_done_call_checks_the_sensitive_arg_against_its_hash(
    stack: Any, home: Home, redis_url: str
) -> None:
    h = stack.call_tool("login", {"user": "bob", "password": "s3cret-pw"}, principal="agent-a")
    h.result(20)
    missing = run_cli(redis_url, home, "audit", "replay", h.call_id, code=2)
    assert "replay_refused" in missing and "--arg password=VALUE" in missing
    wrong = run_cli(redis_url, home, "audit", "replay", h.call_id, "--arg", "password=guess", code=2)
    assert "not the one call" in wrong
    extra = run_cli(redis_url, home, "audit", "replay", h.call_id, "--arg", "user=mallory", code=2)
    assert "only redacted arguments may be supplied" in extra

    out = run_cli(redis_url, home, "audit", "replay", h.call_id, "--arg", "password=s3cret-pw")
    assert "recorded" in out and "replay" in out and "same outcome as recorded" in out
    assert "matched their recorded hash" in out and "s3cret-pw" not in out
    # The replay is a call of its own, by the same principal, with its own audit record.
    records = [json.loads(x) for x in run_cli(redis_url, home, "audit", "list", "--json").splitlines()]
    assert [(r["principal"], r["state"], r["args"]["user"]) for r in records] == [
        ("agent-a", "done", "bob")
    ] * 2
    assert records[0]["call_id"] != h.call_id and records[0]["args"]["password"] == AuditLog(stack.conn).digest("s3cret-pw")


def test_replay_of_a_failed_call_shows_the_new_result_beside_the_old(
    stack: Any, home: Home, redis_url: str, tmp_path: Path
) -> None:
    target = tmp_path / "later.txt"
    h = stack.call_tool("cat", {"path": str(target)})
    with pytest.raises(CallFailed):
        h.result(20)
    again = run_cli(redis_url, home, "audit", "replay", h.call_id)
    assert again.count("failed") >= 2 and "same outcome as recorded" in again

    target.write_text("now it exists")
    out = run_cli(redis_url, home, "audit", "replay", h.call_id)
    row = next(line for line in out.splitlines() if line.startswith("state"))
    assert row.split() == ["state", "failed", "done"]
    result_row = next(line for line in out.splitlines() if line.startswith("result"))
    assert result_row.rstrip().endswith("now it exists")
    assert "the outcome differs from the recorded one" in out


def test_export_writes_jsonl_since_a_time(stack: Any, home: Home, redis_url: str, tmp_path: Path) -> None:
    for i in range(3):
        stack.call_tool("login", {"user": f"u{i}", "password": "pw"}, principal="agent-a").result(20)
    lines = run_cli(redis_url, home, "audit", "export", "--since", "10m").splitlines()
    assert [json.loads(x)["args"]["user"] for x in lines] == ["u0", "u1", "u2"]  # oldest first
    target = tmp_path / "out.jsonl"
    run_cli(redis_url, home, "audit", "export", "--tool", "login", "-o", str(target))
    assert len(target.read_text().splitlines()) == 3
    assert run_cli(redis_url, home, "audit", "export", "--since", str(time.time() + 60)) == ""


# --- no broker needed -----------------------------------------------------------------------------


def test_parse_when_reads_durations_iso_times_and_unix_seconds() -> None:
    now = 1_700_000_000.0
    assert parse_when("90s", now) == now - 90
    assert parse_when("15m", now) == now - 900
    assert parse_when("2h", now) == now - 7200
    assert parse_when("7d", now) == now - 7 * 86400
    assert parse_when("1700000000", now) == now
    assert (
        parse_when("2024-01-31T08:00:00+00:00")
        == datetime.fromisoformat("2024-01-31T08:00:00+00:00").timestamp()
    )
    with pytest.raises(click.BadParameter):
        parse_when("yesterday-ish")
    # Times an audit stream id cannot hold are refused here, not sent to Redis (which would refuse them).
    for out_of_range in ("nan", "-1", "1e20", "inf", "9999999999999999999999", "99999999999h", "1969-12-31T00:00+00:00"):
        with pytest.raises(click.BadParameter, match="out of range"):
            parse_when(out_of_range, now)


KEYED = keyed_hash(b"k")


def record(**kw: Any) -> AuditRecord:
    return AuditRecord.of(call_id="c1", kind="tool", state="done", tool_name="t", digest=KEYED, **kw)


def test_plan_refuses_llm_calls_and_requires_every_redacted_argument() -> None:
    with pytest.raises(ReplayRefused, match="only tool calls"):
        replay.plan(AuditRecord.of(call_id="c1", kind="llm", state="done", model="m"), {})
    rec = record(args={"q": "curl -H 'Authorization: Bearer abcdef123456'", "api_key": "k-123", "n": 2})
    assert rec.args["api_key"] == "***" and "abcdef123456" not in rec.args["q"]
    with pytest.raises(ReplayRefused) as info:
        replay.plan(rec, {"q": "x"})
    assert info.value.details["missing"] == ["api_key"]
    plan = replay.plan(rec, {"q": "curl -H 'Authorization: Bearer abcdef123456'", "api_key": "k-123"})
    assert plan.args == {"q": "curl -H 'Authorization: Bearer abcdef123456'", "api_key": "k-123", "n": 2}
    assert plan.unverified == ("api_key", "q") and plan.verified == ()


def test_plan_matches_a_sensitive_value_as_text_or_as_json() -> None:
    rec = record(args={"pin": 1234, "label": "ci"}, sensitive=("pin",), principal="p", session_id="s")
    assert rec.args["pin"] == KEYED(1234)
    plan = replay.plan(rec, {"pin": "1234"}, KEYED)  # typed on a command line, it is text; the hash says int
    assert plan.args == {"pin": 1234, "label": "ci"} and plan.verified == ("pin",)
    assert plan.context == {"principal": "p", "session_id": "s", "replay_of": rec.call_id}  # (named in its record)
    with pytest.raises(ReplayRefused, match="not the one"):
        replay.plan(rec, {"pin": "4321"}, KEYED)


def test_events_of_an_ended_call_says_where_its_progress_events_were(
    redis_url: str, home: Home, gateway: Any, workers: Any
) -> None:
    home.tool("progressing", function="tests.workers.executors.pyfuncs:with_progress", timeout=10)
    gateway.sync_tools()
    workers(1)
    handle = gateway.call_tool("progressing", {"n": 2})
    handle.result(20)
    out = run_cli(redis_url, home, "events", handle.call_id).splitlines()
    states = [line.split()[2] for line in out if line.startswith("[")]
    assert states == ["pending", "routing", "executing", "formatting", "done"]
    # (its progress event was not kept once it ended: a line says so, where it was)
    assert "1 event not kept once the call ended" in out[3] and "workers.keep_history" in out[3], out
