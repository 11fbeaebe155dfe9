"""The ``chat`` agent loop end to end: LLM and tool calls on real worker processes, a local LLM server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker import events, keys
from broker.audit_store import AuditLog
from broker.records import envelope_of
from hermes_gateway.chat import ChatSession
from tests.conftest import Home
from tests.llm_server import LLMServer, Reply

pytestmark = pytest.mark.e2e

MODEL = "hermes-test"
WEATHER = "hermes_gateway.demo_tools:weather"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture
def llm(home: Home) -> Iterator[LLMServer]:
    """The test server, config.yaml pointing the workers at it, and a python get_weather tool."""
    with LLMServer(model=MODEL) as server:
        home.config({"model": {"provider": "openai-compatible", "base_url": server.base_url, "model": MODEL}})
        home.tool(
            "get_weather", function=WEATHER, description="Weather in a city", input_schema=WEATHER_SCHEMA
        )
        yield server


def context_of(conn: Any, call_id: str) -> dict[str, Any]:
    return envelope_of(conn.hget(keys.job(call_id), "data")).context


def test_a_weather_question_runs_the_tool_on_a_worker_and_the_answer_quotes_its_result(
    llm: LLMServer, gateway: Any, workers: Any, conn: Any
) -> None:
    gateway.sync_tools()
    workers(queues="tools,llm")
    session = ChatSession(gateway, session_id="s-weather")
    result = session.ask("What is the weather in Berlin?")

    assert result.finished and len(result.turns) == 2
    first, second = result.turns
    [run] = first.tools
    assert run.ok and run.name == "get_weather" and run.args == {"city": "Berlin"}
    assert run.result["city"] == "Berlin" and run.result["unit"] == "celsius"
    assert result.answer == f"Tool result: {json.dumps(run.result, ensure_ascii=False)}"

    # The tool call ran on the worker with the conversation's ids; its parent is the LLM call that asked.
    ctx = context_of(conn, run.call_id)
    assert ctx["session_id"] == "s-weather" and ctx["turn_id"] == first.turn_id
    assert ctx["tool_call_id"] == run.tool_call_id and ctx["parent_call_id"] == first.llm_call_id
    assert context_of(conn, first.llm_call_id)["turn_id"] == first.turn_id != second.turn_id
    assert [e.state for e in events.history(conn, run.call_id) if e.type == events.TRANSITION][-1] == "done"
    record = AuditLog(conn).get(run.call_id)
    assert record is not None and record.tool_call_id == run.tool_call_id and record.session_id == "s-weather"

    # The second LLM request carried the assistant's tool call and the tool message answering it.
    offered, answered = llm.chat_requests
    assert [t["function"]["name"] for t in offered.body["tools"]] == ["get_weather"]
    assistant, tool_msg = answered.body["messages"][-2:]
    assert assistant["tool_calls"][0]["id"] == run.tool_call_id
    assert tool_msg == {"role": "tool", "tool_call_id": run.tool_call_id, "content": run.content()}


def test_the_tool_calls_of_one_answer_run_side_by_side_and_failures_go_back_to_the_model(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, conn: Any
) -> None:
    home.sleep_tool()
    gateway.sync_tools()
    llm.script(
        Reply(
            tool_calls=[
                {"name": "sleep", "arguments": {"seconds": 0.6}},
                {"name": "sleep", "arguments": {"seconds": 0.6}},
                {"name": "get_weather", "arguments": {"city": "Atlantis"}},  # the tool raises
                {"name": "no_such_tool", "arguments": {}},
                {"name": "sleep", "arguments": "{not json"},
            ]
        ),
        Reply(text="done"),
    )
    workers(queues="tools,llm")
    result = ChatSession(gateway).ask("go")

    assert result.answer == "done"
    slow1, slow2, weather, unknown, bad = result.turns[0].tools
    assert slow1.ok and slow2.ok
    # Both sleeps were executing at once: each started before the other ended.
    h1, h2 = events.history(conn, slow1.call_id), events.history(conn, slow2.call_id)
    start = {cid: next(e.ts for e in h if e.state == "executing") for cid, h in ((1, h1), (2, h2))}
    end = {cid: h[-1].ts for cid, h in ((1, h1), (2, h2))}
    assert start[2] < end[1] and start[1] < end[2]
    assert (
        weather.error is not None and weather.call_id is not None and "Atlantis" in weather.error["message"]
    )
    assert unknown.error is not None and unknown.error["type"] == "unknown_tool" and unknown.call_id is None
    assert bad.error is not None and bad.error["type"] == "invalid_args" and bad.call_id is None
    tool_msgs = [m for m in llm.chat_requests[-1].body["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == [r.tool_call_id for r in result.turns[0].tools]
    assert "unknown_tool" in tool_msgs[3]["content"] and "invalid_args" in tool_msgs[4]["content"]


def test_the_loop_stops_at_the_turn_limit_without_an_answer(
    llm: LLMServer, gateway: Any, workers: Any
) -> None:
    gateway.sync_tools()
    llm.rule = lambda body: Reply(tool_calls=[{"name": "get_weather", "arguments": {"city": "Paris"}}])
    workers(queues="tools,llm")
    result = ChatSession(gateway, max_turns=2).ask("weather forever")
    assert result.answer is None and not result.finished
    assert len(result.turns) == 2 and len(llm.chat_requests) == 2
    assert all(t.tools[0].ok for t in result.turns)


def run_cli(home: Home, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if k != "HERMES_REDIS_URL"}
    child.update({"HERMES_HOME": str(home.path), **(env or {})})
    return subprocess.run(
        [str(Path(sys.executable).parent / "hermes-gateway"), "chat", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=child,
    )


def test_cli_chat_reply_exactly_ok_prints_ok_with_the_embedded_broker_and_a_local_worker(
    llm: LLMServer, home: Home
) -> None:
    proc = run_cli(home, "--query", "Reply exactly ok")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\n"
    assert len(llm.chat_requests) == 1


def test_cli_chat_streams_the_answer_and_verbose_lists_the_calls(
    llm: LLMServer, home: Home, redis_url: str, workers: Any
) -> None:
    workers(queues="tools,llm")
    proc = run_cli(
        home, "-q", "What is the weather in Paris?", "--stream", "-v", env={"HERMES_REDIS_URL": redis_url}
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith('Tool result: {"city": "Paris"')  # printed once
    assert "turn 1: llm call" in proc.stderr and 'get_weather({"city": "Paris"}) call ' in proc.stderr
    assert "turn 2: llm call" in proc.stderr and "-> answer" in proc.stderr
    assert llm.chat_requests[-1].body["stream"] is True


def test_cli_chat_without_an_answer_within_max_turns_exits_1(llm: LLMServer, home: Home) -> None:
    llm.rule = lambda body: Reply(tool_calls=[{"name": "get_weather", "arguments": {"city": "Paris"}}])
    proc = run_cli(home, "-q", "loop", "--max-turns", "1")
    assert proc.returncode == 1
    assert "no answer within 1 turn(s)" in proc.stderr and proc.stdout == ""
