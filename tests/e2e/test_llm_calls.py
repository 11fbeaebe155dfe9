"""LLM calls through real worker processes against the local OpenAI-compatible test server.

The server runs in this process; the worker reads its base_url from ``model:`` in config.yaml and the
api key from the environment (``${HERMES_E2E_LLM_KEY}``), which the server requires.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker import events, keys
from broker.audit import AuditLog
from broker.codec import pack
from broker.errors import BudgetExceeded, CallFailed
from broker.limits import Limits
from middleware import enable_plugin
from tests.conftest import Home, wait_until
from tests.llm_server import LLMServer, Reply
from workers.telemetry import read_stats

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
KEY = f"sk-e2e-{uuid.uuid4().hex}"
KEY_ENV = {"HERMES_E2E_LLM_KEY": KEY}
MODEL = "hermes-test"
ASK = [{"role": "user", "content": "Say something"}]

# An observer plugin that writes every LLM step it sees, in order, to $HERMES_E2E_ORDER_LOG.
RECORDER = """
import json, os, threading

_lock = threading.Lock()


def _write(step, kw, **fields):
    line = {"step": step, "api_request_id": kw.get("api_request_id"), **fields}
    with _lock, open(os.environ["HERMES_E2E_ORDER_LOG"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\\n")


def _tagged(request):
    return bool(((request.get("extra_body") or {}).get("metadata") or {}).get("hermes_middleware_demo"))


def register(ctx):
    ctx.register_middleware("llm_request", on_llm_request)
    ctx.register_middleware("llm_execution", on_llm_execution)
    ctx.register_hook("pre_api_request", on_pre)
    ctx.register_hook("post_api_request", on_post)
    ctx.register_hook("api_request_error", on_error)


def on_llm_request(**kw):
    _write("llm_request", kw, provider=kw["provider"], model=kw["model"], api_mode=kw["api_mode"],
           session_id=kw["session_id"], messages=len(kw["request"]["messages"]))


def on_llm_execution(**kw):
    _write("llm_execution", kw, tagged=_tagged(kw["request"]))
    response = kw["next_call"](kw["request"])
    _write("llm_execution_returned", kw)
    return response


def on_pre(**kw):
    # Hermes' shapes: the request as {"method", "body"}, the response as a summary.
    _write("pre_api_request", kw, tagged=_tagged(kw["request"]["body"]),
           trace=[e.get("source") for e in kw["middleware_trace"]], base_url=kw["base_url"],
           api_call_count=kw["api_call_count"], message_count=kw["message_count"])


def on_post(**kw):
    _write("post_api_request", kw, response_model=kw.get("response_model"),
           finish_reason=kw.get("finish_reason"), content=kw["response"]["assistant_message"]["content"],
           chars=kw["assistant_content_chars"])


def on_error(**kw):
    _write("api_request_error", kw, error=kw["error"]["type"], message=kw["error"]["message"])
"""


@pytest.fixture
def llm(home: Home) -> Iterator[LLMServer]:
    """The test server, and config.yaml pointing the workers at it (request it before ``gateway``)."""
    with LLMServer(api_key=KEY, model=MODEL) as server:
        home.config(
            {
                "model": {
                    "provider": "openai-compatible",
                    "base_url": server.base_url,
                    "api_key": "${HERMES_E2E_LLM_KEY}",
                    "model": MODEL,
                    "max_retries": 2,
                }
            }
        )
        yield server


def add_plugin(home: Home, *names: str) -> None:
    """Copy example plugins into ``$HERMES_HOME/plugins`` and enable them."""
    for name in names:
        shutil.copytree(REPO / "examples" / "plugins" / name, home.path / "plugins" / name)
        enable_plugin(home.path, name)


def add_recorder(home: Home, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The order-recording plugin; returns its log and the worker environment it needs."""
    root = home.path / "plugins" / "order-recorder"
    root.mkdir()
    (root / "plugin.yaml").write_text("name: order-recorder\nversion: '0.1.0'\nkind: standalone\n")
    (root / "__init__.py").write_text(RECORDER)
    enable_plugin(home.path, "order-recorder")
    log = tmp_path / "order.jsonl"
    return log, {"HERMES_E2E_ORDER_LOG": str(log)}


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def transitions(evs: list[events.Event]) -> list[str]:
    return [e.state for e in evs if e.type == events.TRANSITION]


def assert_no_secret(conn: Any, call_id: str, *texts: str) -> None:
    raw = b"".join(conn.lrange(keys.history(call_id), 0, -1)) + (conn.get(keys.ended(call_id)) or b"")
    raw += pack(conn.hgetall(keys.job(call_id)))
    assert KEY.encode() not in raw
    for text in texts:
        assert KEY not in text


# -- streaming ---------------------------------------------------------------------------------


def test_stream_deltas_arrive_as_events_before_the_call_ends_and_the_result_is_the_assembled_completion(
    llm: LLMServer, gateway: Any, workers: Any, conn: Any
) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    seen_delta = threading.Event()
    held: list[bool] = []

    def hold(i: int) -> None:
        # The server sends nothing past chunk 4 until the caller has seen a delta event.
        if i == 4:
            held.append(seen_delta.wait(15))

    llm.script(Reply(text=text, chunk_size=4, on_chunk=hold))
    [worker] = workers(queues="llm,tools", env=KEY_ENV)
    handle = gateway.call_llm({"messages": ASK, "stream": True}, session_id="s-1")
    evs = []
    for ev in handle.events(timeout=20):
        evs.append(ev)
        if ev.type == events.DELTA:
            seen_delta.set()
    assert held == [True], "the call did not publish a delta while the provider was still streaming"
    assert transitions(evs) == ["pending", "routing", "executing", "formatting", "done"]
    deltas = [e for e in evs if e.type == events.DELTA]
    assert "".join(d.detail.get("content", "") for d in deltas) == text
    assert len(deltas) >= 10
    assert all(d.kind == "llm" and d.model == MODEL and d.state == "executing" for d in deltas)
    seqs = [e.seq for e in evs]
    assert seqs == list(range(1, len(evs) + 1))
    result = handle.result(5)
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert result["choices"][0]["finish_reason"] == "stop"
    # The worker got the key from ${HERMES_E2E_LLM_KEY} (the server requires it) and leaked it nowhere.
    assert llm.chat_requests[-1].headers["authorization"] == f"Bearer {KEY}"
    assert_no_secret(conn, handle.call_id, worker.log())
    # The audit record names the model config.yaml chose (the request had none) and the provider's status.
    record = wait_until(lambda: AuditLog(conn).get(handle.call_id), 10, message="the audit record")
    assert (record.model, record.status_code, record.model_params.get("stream")) == (MODEL, 200, True)


def test_a_non_streamed_call_returns_the_providers_response_and_the_request_model_overrides_the_config(
    llm: LLMServer, gateway: Any, workers: Any, conn: Any
) -> None:
    workers(queues="llm", env=KEY_ENV)
    handle = gateway.call_llm(
        {"model": "other-model", "messages": [{"role": "user", "content": "Reply exactly ok"}]}
    )
    result = handle.result(20)
    assert result["choices"][0]["message"]["content"] == "ok"
    assert result["model"] == "other-model"
    assert llm.chat_requests[-1].body["model"] == "other-model"
    evs = list(handle.events(timeout=5))  # (what the caller heard: an ended call keeps its last event)
    assert not [e for e in evs if e.type == events.DELTA]
    assert {e.model for e in evs} == {"other-model"}
    assert {e.detail.get("queue") for e in evs if e.state == "pending"} == {"llm"}
    assert "llm:other-model" in {row["key"] for row in Limits(conn).snapshot()}  # its concurrency key


def test_models_past_the_label_cap_count_as_other_in_the_stats_and_the_metrics(
    llm: LLMServer, gateway: Any, workers: Any, conn: Any
) -> None:
    # A caller names any model: once the label holds STATS_MAX_NAMES of them, the next ones add no field.
    conn.sadd(keys.stats_names("llm"), MODEL, *(f"seen-{i}" for i in range(keys.STATS_MAX_NAMES - 1)))
    workers(queues="llm", env=KEY_ENV)
    for model in [MODEL, *(f"fresh-{i}" for i in range(5))]:
        gateway.call_llm({"model": model, "messages": ASK}).result(20)
    stats = wait_until(
        lambda: (s := read_stats(conn)).calls.get(("llm", keys.STATS_OTHER, "done", "")) == 5 and s, 10,
        message="the stats flush",
    )
    assert {name for _kind, name in stats.names} == {MODEL, keys.STATS_OTHER}
    assert {model for _who, model, _way in stats.tokens} == {MODEL, keys.STATS_OTHER}
    assert {name for _who, _kind, name in stats.pcalls} == {MODEL, keys.STATS_OTHER}
    assert conn.scard(keys.stats_names("llm")) == keys.STATS_MAX_NAMES


def test_events_request_shows_the_messages_the_model_was_sent_tool_results_included(
    llm: LLMServer, gateway: Any, workers: Any, redis_url: str, home: Home
) -> None:
    # The seed's pitfall 5: "was the tool result really fed back?" -- the request shows the messages.
    import subprocess
    import sys

    workers(queues="llm", env=KEY_ENV)
    messages = [
        {"role": "user", "content": "北京的天气?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    ]
    handle = gateway.call_llm({"messages": messages, "api_key": "sk-" + "z" * 40})
    handle.result(20)
    env = {"HERMES_REDIS_URL": redis_url, "HERMES_HOME": str(home.path), "PATH": "/usr/bin:/bin"}
    cli = str(Path(sys.executable).parent / "hermes-gateway")
    out = subprocess.run([cli, "events", handle.call_id, "--request"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout[: out.stdout.index("\n}\n") + 2])
    assert shown["kind"] == "llm" and shown["request"]["messages"] == messages
    assert "z" * 40 not in out.stdout  # a key in the request is masked
    assert out.stdout.rstrip().splitlines()[-1].split()[2] == "done"  # then the events, as before


@pytest.mark.parametrize(
    "chunk",
    [
        {"choices": ["text"]},
        {"choices": [{"index": 0, "delta": "text"}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": "get_weather"}]}}]},
    ],
)
def test_a_stream_chunk_of_another_shape_fails_the_call_as_a_provider_error(
    llm: LLMServer, gateway: Any, workers: Any, chunk: dict[str, Any]
) -> None:
    llm.script(Reply(events=[chunk]))
    [worker] = workers(queues="llm", env=KEY_ENV)
    with pytest.raises(CallFailed) as info:
        gateway.call_llm({"messages": ASK, "stream": True}).result(20)
    assert info.value.type == "provider_error"  # (was internal_error: "AttributeError: 'str' object has ...")
    assert str(info.value).startswith("provider sent a malformed stream chunk: {")
    assert len(llm.chat_requests) == 1
    assert "call crashed in the worker" not in worker.log()


def test_a_streamed_call_counts_its_tokens_against_the_principals_daily_budget(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, conn: Any
) -> None:
    # The provider reports a stream's usage only when asked (stream_options.include_usage, as OpenAI does):
    # without it a principal streaming its calls used tokens no budget or statistic counted.
    config = yaml.safe_load((home.path / "config.yaml").read_text())
    home.config({**config, "policy": {"principals": {"alice": {"daily_tokens": 3}}}})
    workers(queues="llm", env=KEY_ENV)
    handle = gateway.call_llm({"messages": ASK, "stream": True}, principal="alice")
    assert handle.result(20)["usage"]["total_tokens"] > 3
    assert llm.chat_requests[-1].body["stream_options"] == {"include_usage": True}
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert int(conn.get(keys.usage_day(day, "alice")) or 0) > 3
    with pytest.raises(BudgetExceeded):
        gateway.call_llm({"messages": ASK, "stream": True}, principal="alice").result(20)
    assert len(llm.chat_requests) == 1


# -- retries -----------------------------------------------------------------------------------


def test_a_429_is_retried_after_its_retry_after_and_each_attempt_runs_the_middleware_again(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, tmp_path: Path
) -> None:
    add_plugin(home, "middleware-demo-llm-tag")
    order_log, env = add_recorder(home, tmp_path)
    llm.script(
        Reply(status=429, error="slow down", headers={"Retry-After": "1"}), Reply(text="second time lucky")
    )
    [worker] = workers(queues="llm", env={**KEY_ENV, **env})
    handle = gateway.call_llm({"messages": ASK, "stream": True})
    assert handle.result(20)["choices"][0]["message"]["content"] == "second time lucky"

    evs = list(handle.events(timeout=5))
    assert transitions(evs) == ["pending", "routing", "executing", "formatting", "done"]
    [retry] = [e for e in evs if e.type == events.PROGRESS]
    assert retry.detail["message"].startswith(
        "retrying after 1.0s: 429 provider returned HTTP 429: slow down"
    )
    assert retry.detail["attempt"] == 1 and retry.detail["next_attempt"] == 2
    assert retry.detail["error"]["details"]["retry_after"] == 1.0
    first, second = llm.chat_requests
    assert second.received - first.received >= 0.95  # Retry-After honoured
    # Each attempt ran the request middleware again: both requests the provider received are tagged.
    assert first.body["metadata"] == second.body["metadata"] == {"hermes_middleware_demo": True}

    steps = read_log(order_log)
    assert [s["step"] for s in steps] == [
        "llm_request", "pre_api_request", "llm_execution", "api_request_error",
        "llm_request", "pre_api_request", "llm_execution", "llm_execution_returned", "post_api_request",
    ]  # fmt: skip
    ids = [s["api_request_id"] for s in steps]
    assert len(set(ids[:4])) == 1 and len(set(ids[4:])) == 1 and ids[0] != ids[4]
    assert steps[3]["error"] == "provider_error" and "429" in steps[3]["message"]
    assert [steps[1]["api_call_count"], steps[5]["api_call_count"]] == [1, 2]  # one per attempt, as Hermes counts
    assert_no_secret(gateway.conn, handle.call_id, worker.log(), order_log.read_text())


def test_an_absurd_retry_after_is_refused_and_the_call_fails_with_the_reason(
    llm: LLMServer, gateway: Any, workers: Any
) -> None:
    llm.script(Reply(status=429, headers={"Retry-After": "3600"}))
    workers(queues="llm", env=KEY_ENV)
    handle = gateway.call_llm({"messages": ASK})
    with pytest.raises(CallFailed) as info:
        handle.result(20)
    assert info.value.type == "provider_error"
    assert "retry after 3600s" in str(info.value) and "giving up" in str(info.value)
    assert handle.final_state == "failed"
    assert len(llm.chat_requests) == 1


def test_a_400_is_not_retried(llm: LLMServer, gateway: Any, workers: Any, conn: Any) -> None:
    llm.script(Reply(status=400, error="bad messages"))
    workers(queues="llm", env=KEY_ENV)
    handle = gateway.call_llm({"messages": ASK})
    with pytest.raises(CallFailed, match="HTTP 400: bad messages") as info:
        handle.result(20)
    assert info.value.type == "provider_error" and info.value.details["status"] == 400
    assert len(llm.chat_requests) == 1
    record = wait_until(lambda: AuditLog(conn).get(handle.call_id), 10, message="the audit record")
    assert (record.state, record.model, record.status_code) == ("failed", MODEL, 400)
    assert not [e for e in handle.events(timeout=5) if e.type == events.PROGRESS]


def test_a_worker_without_the_keys_variable_says_so_at_start_and_in_the_401(
    llm: LLMServer, gateway: Any, workers: Any
) -> None:
    # The caller's shell has the key; the worker's environment does not (config.yaml reads ${HERMES_E2E_LLM_KEY}).
    (worker,) = workers(queues="llm")  # (KEY_ENV not given: the variable is unset there)
    wait_until(lambda: "${HERMES_E2E_LLM_KEY}" in worker.log(), 10, message="the worker's start-up warning")
    assert "config.yaml names a variable not set in this worker's environment" in worker.log()
    with pytest.raises(CallFailed, match=r"HTTP 401: .*model.api_key reads \$\{HERMES_E2E_LLM_KEY\}, which is not set"):
        gateway.call_llm({"messages": ASK}).result(20)


def test_retries_stop_after_model_max_retries_with_the_last_error(
    llm: LLMServer, gateway: Any, workers: Any
) -> None:
    llm.script(*(Reply(status=503, error="overloaded", headers={"Retry-After": "0"}) for _ in range(4)))
    workers(queues="llm", env=KEY_ENV)
    handle = gateway.call_llm({"messages": ASK})
    with pytest.raises(CallFailed, match="HTTP 503: overloaded"):
        handle.result(20)
    assert len(llm.chat_requests) == 3  # the first attempt and model.max_retries = 2 more
    retries = [e.detail for e in handle.events(timeout=5) if e.type == events.PROGRESS]
    assert [(r["attempt"], r["message"]) for r in retries] == [
        (1, "retrying after 0.0s: 503 provider returned HTTP 503: overloaded"),
        (2, "retrying after 0.0s: 503 provider returned HTTP 503: overloaded"),
    ]


def test_a_provider_that_does_not_answer_in_time_fails_the_call_with_provider_timeout(
    llm: LLMServer, gateway: Any, workers: Any
) -> None:
    llm.script(Reply(text="too late", delay=10))
    workers(queues="llm", env=KEY_ENV)
    handle = gateway.call_llm({"messages": ASK}, timeout=1)
    with pytest.raises(CallFailed) as info:
        handle.result(10)
    assert info.value.type == "provider_timeout"
    assert len(llm.chat_requests) == 1  # no time was left for another attempt


# -- cancellation ------------------------------------------------------------------------------


def test_cancel_stops_a_streaming_call_in_the_worker_within_a_second(
    llm: LLMServer, gateway: Any, workers: Any
) -> None:
    llm.script(Reply(text="x" * 400, chunk_size=4, chunk_delay=0.1))  # ~10 s of stream
    workers(queues="llm", env=KEY_ENV)
    handle = gateway.call_llm({"messages": ASK, "stream": True})
    deltas = 0
    cancelled_at = ended_at = 0.0
    for ev in handle.events(timeout=20):
        if ev.type == events.DELTA:
            deltas += 1
            if deltas == 3:
                cancelled_at = time.monotonic()
                assert handle.cancel()
        if ev.terminal:
            ended_at = time.monotonic()
    assert handle.final_state == "cancelled"
    assert 0 < ended_at - cancelled_at < 1.5
    assert deltas < 100
    # The worker hung up on the provider: the server saw the client go away mid-stream.
    wait_until(lambda: llm.client_gone >= 1, timeout=3, message="the provider stream to be abandoned")
    assert len(llm.chat_requests) == 1


# -- the contract's order with several plugins -------------------------------------------------


def test_the_llm_order_with_the_example_plugins_and_an_observer(
    llm: LLMServer, home: Home, gateway: Any, workers: Any, tmp_path: Path
) -> None:
    add_plugin(home, "middleware-demo-llm-tag", "middleware-demo-llm-timing")
    order_log, env = add_recorder(home, tmp_path)
    [worker] = workers(queues="llm", env={**KEY_ENV, **env})
    handle = gateway.call_llm(
        {"messages": [{"role": "user", "content": "Reply exactly tagged"}], "stream": True},
        session_id="sess-7",
        api_request_id="req-7",
    )
    assert handle.result(20)["choices"][0]["message"]["content"] == "tagged"

    # llm_request ran before the provider call: the request the provider RECEIVED carries the tag.
    [received] = llm.chat_requests
    assert received.body["metadata"] == {"hermes_middleware_demo": True}
    assert "extra_body" not in received.body
    steps = read_log(order_log)
    assert [s["step"] for s in steps] == [
        "llm_request", "pre_api_request", "llm_execution", "llm_execution_returned", "post_api_request",
    ]  # fmt: skip
    first = steps[0]
    assert (first["provider"], first["model"], first["api_mode"]) == (
        "openai-compatible",
        MODEL,
        "chat_completions",
    )
    assert first["session_id"] == "sess-7" and {s["api_request_id"] for s in steps} == {"req-7"}
    # pre_api_request and llm_execution saw the effective (tagged) request, with the trace entry.
    assert steps[1]["tagged"] and "middleware-demo" in steps[1]["trace"]
    assert steps[1]["base_url"] == llm.base_url and steps[1]["message_count"] == 1
    assert steps[2]["tagged"]
    assert steps[4] == {
        **steps[4], "response_model": MODEL, "finish_reason": "stop", "content": "tagged", "chars": 6
    }  # fmt: skip
    # The timing wrapper logged elapsed_ms in the worker's output.
    wait_until(
        lambda: "llm_execution elapsed_ms=" in worker.log(), timeout=5, message="the timing plugin's line"
    )
