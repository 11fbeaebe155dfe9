"""The ``chat`` agent loop end to end: LLM and tool calls on real worker processes, a local LLM server."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker import events, keys
from broker.audit import CONTEXT_KEYS, AuditLog
from broker.calls import envelope_of
from hermes_gateway.chat import ChatSession
from tests.conftest import Home, sigint_as_by_default
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
    """The context a call ran with: its envelope's (an ended LLM call keeps it), else its audit record's
    (an ended tool call keeps no envelope)."""
    data = conn.hget(keys.job(call_id), "data")
    if data is not None:
        return envelope_of(data).context
    record = AuditLog(conn).get(call_id)
    assert record is not None, f"no envelope and no audit record of {call_id}"
    return {k: getattr(record, k) for k in CONTEXT_KEYS if getattr(record, k) is not None}


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
    # ... and the runtime context of the API request that asked for it (the seed's list for every callback).
    assert ctx["api_request_id"] == f"{first.llm_call_id}-1"
    assert first.api_request == {"api_request_id": f"{first.llm_call_id}-1", "provider": "openai-compatible",
                                 "model": MODEL, "api_mode": "chat_completions"}
    assert context_of(conn, first.llm_call_id)["turn_id"] == first.turn_id != second.turn_id
    assert [e.state for e in events.history(conn, run.call_id) if e.type == events.TRANSITION][-1] == "done"
    record = AuditLog(conn).get(run.call_id)
    assert record is not None and record.tool_call_id == run.tool_call_id and record.session_id == "s-weather"
    # One question is one trace: both LLM calls and the tool call carry its trace id (each their own span).
    traces = {events.history(conn, c)[-1].trace_id for c in (first.llm_call_id, run.call_id, second.llm_call_id)}
    assert len(traces) == 1 and "" not in traces

    # The second LLM request carried the assistant's tool call and the tool message answering it.
    offered, answered = llm.chat_requests
    assert [t["function"]["name"] for t in offered.body["tools"]] == ["get_weather"]
    assistant, tool_msg = answered.body["messages"][-2:]
    assert assistant["tool_calls"][0]["id"] == run.tool_call_id
    assert tool_msg == {"role": "tool", "tool_call_id": run.tool_call_id, "content": run.content()}
    # The next question of the session is a trace of its own.
    nxt = session.ask("And in Paris?").turns[0].llm_call_id
    assert events.history(conn, nxt)[-1].trace_id not in traces


def test_with_an_sdk_tracer_a_question_is_one_chat_span_whose_children_are_its_calls(
    llm: LLMServer, gateway: Any, workers: Any, conn: Any
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from broker import otel

    gateway.sync_tools()
    workers(queues="tools,llm")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.use_providers(tracer_provider=provider)
    try:
        result = ChatSession(gateway).ask("What is the weather in Berlin?")
    finally:
        otel.use_providers()
    spans = exporter.get_finished_spans()
    [chat] = [sp for sp in spans if sp.name == "chat"]
    sends = [sp for sp in spans if sp.name.startswith("send ")]
    assert len(sends) == 3 and {sp.parent.span_id for sp in sends} == {chat.context.span_id}  # 2 LLM + 1 tool
    calls = [result.turns[0].llm_call_id, result.turns[0].tools[0].call_id, result.turns[1].llm_call_id]
    assert {events.history(conn, c)[-1].trace_id for c in calls} == {format(chat.context.trace_id, "032x")}


def test_the_tool_calls_of_one_answer_run_side_by_side_and_failures_go_back_to_the_model(
    keep_history: None, llm: LLMServer, home: Home, gateway: Any, workers: Any, conn: Any
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
    # Both sleeps were executing at once: each started before the other ended (whole histories kept).
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


def cli_env(home: Home, env: dict[str, str] | None = None) -> dict[str, str]:
    child = {k: v for k, v in os.environ.items() if k != "HERMES_REDIS_URL"}
    child.update({"HERMES_HOME": str(home.path), **(env or {})})
    return child


CLI = str(Path(sys.executable).parent / "hermes-gateway")


def run_cli(
    home: Home, *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``hermes-gateway chat ARGS``; ``stdin`` is piped to it when given."""
    return subprocess.run(
        [CLI, "chat", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(home, env),
        input=stdin,
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


def test_cli_chat_with_an_unknown_tools_name_says_so_before_asking(llm: LLMServer, home: Home) -> None:
    proc = run_cli(home, "-q", "hi", "--tools", "get_weather,get_wether")
    assert proc.returncode == 2 and "unknown_tool: no such tool: get_wether (known: " in proc.stderr
    assert llm.chat_requests == []


# -- chat without --query: a conversation read from stdin --------------------------------------------


def roles(request: Any) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in request.body["messages"]]


def test_cli_chat_answers_piped_lines_in_one_conversation_and_later_turns_carry_the_earlier_ones(
    llm: LLMServer, home: Home
) -> None:
    stdin = "北京的天气怎么样？\n\n   \nReply exactly ok\n"  # the blank lines are skipped
    proc = run_cli(home, "--system", "be brief", stdin=stdin)

    assert proc.returncode == 0, proc.stderr
    weather, ok = proc.stdout.splitlines()
    assert weather.startswith('Tool result: {"city": "北京"') and ok == "ok"
    assert "> " not in proc.stdout and "hermes-gateway chat, session" not in proc.stderr  # piped: no banner

    # 1st question: the tool call and the answer quoting its result; 2nd: one LLM call.
    asked, answered, second = llm.chat_requests
    assert roles(asked) == [("system", "be brief"), ("user", "北京的天气怎么样？")]
    assert [m["role"] for m in answered.body["messages"]] == ["system", "user", "assistant", "tool"]
    # The second question went to the model after the whole first exchange, in the same conversation.
    assert [m["role"] for m in second.body["messages"]] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert second.body["messages"][:4] == answered.body["messages"]
    assert second.body["messages"][4] == {"role": "assistant", "content": weather}
    assert second.body["messages"][5] == {"role": "user", "content": "Reply exactly ok"}


def test_cli_chat_streams_and_verbose_in_a_conversation_under_one_session_id(
    llm: LLMServer, home: Home, redis_url: str, workers: Any, conn: Any
) -> None:
    workers(queues="tools,llm")
    proc = run_cli(
        home, "--stream", "-v", "--session-id", "s-repl", "--tools", "get_weather",
        stdin="What is the weather in Paris?\nReply exactly done\n", env={"HERMES_REDIS_URL": redis_url},
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()  # each answer printed once, on its own line
    assert first.startswith('Tool result: {"city": "Paris"') and second == "done"
    assert proc.stderr.count("session s-repl: ") == 2
    assert "turn 1: llm call" in proc.stderr and "turn 2: llm call" in proc.stderr
    assert all(r.body["stream"] is True for r in llm.chat_requests) and len(llm.chat_requests) == 3
    # Turn ids run on across the questions of one session.
    llm_calls = [e for e in proc.stderr.splitlines() if e.startswith("turn ") and "llm call" in e]
    call_ids = [line.split("llm call ")[1].split()[0] for line in llm_calls]
    assert [context_of(conn, c)["turn_id"] for c in call_ids] == ["s-repl-t1", "s-repl-t2", "s-repl-t3"]


@pytest.mark.parametrize("word", ["exit", "quit", "  QUIT  "])
def test_cli_chat_stops_at_exit_or_quit_before_the_lines_after_it(
    llm: LLMServer, home: Home, word: str
) -> None:
    proc = run_cli(home, stdin=f"Reply exactly one\n{word}\nReply exactly two\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "one\n"
    assert len(llm.chat_requests) == 1


def test_cli_chat_with_nothing_on_stdin_asks_nothing_and_exits_0(llm: LLMServer, home: Home) -> None:
    proc = run_cli(home, stdin="")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "error" not in proc.stderr
    assert llm.chat_requests == []


def test_cli_chat_reports_a_failing_turn_goes_on_with_the_next_and_exits_nonzero(
    llm: LLMServer, home: Home
) -> None:
    def rule(body: dict[str, Any]) -> Reply | None:
        if "fail" in str(body["messages"][-1].get("content")):
            return Reply(status=400, error="bad messages")
        return None

    llm.rule = rule
    proc = run_cli(home, stdin="please fail\nReply exactly ok\n")

    assert proc.returncode == 1
    assert "error: provider_error: " in proc.stderr and "HTTP 400: bad messages" in proc.stderr
    assert proc.stdout == "ok\n"
    failed, answered = llm.chat_requests
    assert roles(failed) == [("user", "please fail")]
    # The failed question left no trace in the conversation: the next one starts where it stood.
    assert roles(answered) == [("user", "Reply exactly ok")]


def test_cli_chat_without_an_answer_within_max_turns_goes_on_and_exits_1(llm: LLMServer, home: Home) -> None:
    def rule(body: dict[str, Any]) -> Reply | None:
        if "exactly" in str(body["messages"][-1].get("content")):
            return None  # the default rule answers it
        return Reply(tool_calls=[{"name": "get_weather", "arguments": {"city": "Paris"}}])

    llm.rule = rule
    proc = run_cli(home, "--max-turns", "1", stdin="loop\nReply exactly ok\n")
    assert proc.returncode == 1
    assert "no answer within 1 turn(s)" in proc.stderr and proc.stdout == "ok\n"
    assert len(llm.chat_requests) == 2
    # The unanswered question and its tool call are left out of the conversation that goes on.
    assert roles(llm.chat_requests[1]) == [("user", "Reply exactly ok")]


def _read_until(stream: Any, needle: bytes, seen: bytearray, timeout: float = 30.0) -> None:
    """Read ``stream`` (a pipe) into ``seen`` until ``needle`` is in it."""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} not seen in {bytes(seen)!r}"
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            chunk = os.read(stream.fileno(), 4096)
            assert chunk, f"stream ended before {needle!r}: {bytes(seen)!r}"
            seen += chunk


def test_cli_chat_interrupted_while_the_model_answers_cancels_its_call(
    llm: LLMServer, home: Home, redis_url: str, workers: Any, conn: Any, wait_until: Any
) -> None:
    llm.script(Reply(text="late", delay=30))  # the model takes its time
    workers(queues="llm")
    chat = subprocess.Popen([CLI, "chat", "-q", "Reply exactly ok"], env=cli_env(home, {"HERMES_REDIS_URL": redis_url}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_by_default)  # fmt: skip
    try:
        leased = wait_until(lambda: conn.zrange(keys.leases(keys.tag("llm")), 0, -1), 30, message="the LLM call to run")
        chat.send_signal(signal.SIGINT)  # Ctrl-C while it waits for the answer
        _out, err = chat.communicate(timeout=30)
    finally:
        if chat.poll() is None:
            chat.kill()
    assert chat.returncode == 130 and "interrupted: the calls of this question were cancelled" in err, err
    call_id = leased[0].decode()
    ended = wait_until(lambda: [e for e in events.history(conn, call_id) if e.terminal], 15, message="its end")
    assert ended[-1].state == "cancelled"


def test_cli_chat_at_a_terminal_shows_a_banner_and_prompt_and_ctrl_c_at_the_prompt_ends_cleanly(
    llm: LLMServer, home: Home
) -> None:
    import psutil

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [CLI, "chat"], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=cli_env(home), start_new_session=True, preexec_fn=sigint_as_by_default,
    )
    os.close(slave)
    try:
        assert proc.stderr is not None and proc.stdout is not None
        err = bytearray()
        _read_until(proc.stderr, b"> ", err, timeout=120)  # generous: a loaded machine starts slowly
        assert b"exit" in err and b"quit" in err and b"Ctrl-D" in err  # the banner says how to quit
        os.write(master, b"Reply exactly hi\n")
        err.clear()
        _read_until(proc.stderr, b"> ", err, timeout=120)  # the next prompt, after the answer: it reads stdin
        # Its own worker and embedded broker are not in its process group: Ctrl-C at a terminal signals the
        # foreground group, and must reach only the chat, which stops them in order (workers first, while
        # their broker is still up). When they got the SIGINT too, the broker could exit under a worker,
        # whose stop then waited for it (30 s and more on a loaded machine).
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children and all(os.getpgid(c.pid) != proc.pid for c in children), [
            (c.pid, c.name(), os.getpgid(c.pid)) for c in children
        ]
        err.clear()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        # It leaves the prompt at once (a slow machine takes seconds for that, not a minute) ...
        _read_until(proc.stderr, b"\n", err, timeout=30)
        # ... and then exits after stopping its worker and broker (bounded: SIGKILL after 30 s each).
        out, rest = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert proc.returncode == 0, rest
    assert out == b"hi\n"  # the prompt and banner stay off stdout
    assert b"Traceback" not in rest and b"Aborted" not in rest
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert len(llm.chat_requests) == 1
