"""The OpenAI-compatible provider against a real local HTTP server."""

from __future__ import annotations

import email.utils
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from broker.errors import CallCancelled, ConfigError, ProviderError, ProviderTimeout
from broker.settings import ModelSettings
from tests.llm_server import Reply
from workers.providers.backoff import retry_delay
from workers.providers.openai_compat import OpenAICompatProvider, create

from .support import API_KEY, make_ctx, user

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _raises(provider: OpenAICompatProvider, exc: type[Exception], **request: Any) -> Any:
    request.setdefault("messages", user("hi"))
    with pytest.raises(exc) as info:
        provider.complete(request, make_ctx())
    return info.value


# --- requests and answers ----------------------------------------------------------------------------


def test_non_streaming_completion_returns_the_servers_chat_completion(provider, server):
    result = provider.complete({"messages": user("Reply exactly ok")}, make_ctx())
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"]["total_tokens"] == result["usage"]["prompt_tokens"] + 1


def test_request_carries_body_auth_trace_headers_and_extra_body(provider, server):
    ctx = make_ctx(
        call_id="c-42",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        tracestate="vendor=1",
    )
    request = {
        "messages": user("hello"),
        "temperature": 0.2,
        "extra_body": {"top_k": 5},
        "extra_headers": {"X-Custom": "yes"},
        "timeout": 3,
    }
    provider.complete(request, ctx)
    seen = server.chat_requests[-1]
    assert seen.body == {"messages": user("hello"), "temperature": 0.2, "top_k": 5, "model": "test-model"}
    assert seen.headers["authorization"] == f"Bearer {API_KEY}"
    assert seen.headers["traceparent"] == ctx.traceparent
    assert seen.headers["tracestate"] == "vendor=1"
    assert seen.headers["x-hermes-call-id"] == "c-42"
    assert seen.headers["x-custom"] == "yes"


def test_model_in_the_request_wins_over_the_configured_default(provider, server):
    result = provider.complete({"model": "other", "messages": user("x")}, make_ctx())
    assert server.chat_requests[-1].body["model"] == "other"
    assert result["model"] == "other"


def test_tool_call_comes_back_in_the_message(provider):
    result = provider.complete({"messages": user("weather in Paris?"), "tools": [WEATHER_TOOL]}, make_ctx())
    choice = result["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_concurrent_calls_share_one_provider(provider):
    def one(n: int) -> str:
        result = provider.complete(
            {"messages": user(f"Reply exactly n{n}"), "stream": n % 2 == 0}, make_ctx()
        )
        return result["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(16))) == [f"n{n}" for n in range(16)]


# --- streaming -----------------------------------------------------------------------------------------


def test_stream_deltas_reach_on_delta_while_the_server_is_still_sending(provider, server):
    order: list[str] = []
    first_seen = threading.Event()

    def on_chunk(i: int) -> None:
        if i == 2:  # chunk 0 is the role, 1 is "Hello ": hold the rest until the client has seen it
            first_seen.wait(5)
            order.append("server sends the rest")

    def on_delta(delta: dict[str, Any]) -> None:
        if "content" in delta:
            order.append(f"delta {delta['content']!r}")
            first_seen.set()

    server.script(Reply(text="Hello world", chunk_size=6, on_chunk=on_chunk))
    result = provider.complete({"messages": user("x"), "stream": True}, make_ctx(on_delta=on_delta))
    assert order == ["delta 'Hello '", "server sends the rest", "delta 'world'"]
    assert result["choices"][0]["message"]["content"] == "Hello world"


def test_stream_assembles_tool_calls_from_deltas_by_index(provider, server):
    server.script(
        Reply(
            tool_calls=[
                {"id": "call_a", "name": "get_weather", "arguments": {"city": "北京"}},
                {"id": "call_b", "name": "get_time", "arguments": {"tz": "Asia/Shanghai"}},
            ],
            chunk_size=3,
        )
    )
    deltas: list[dict[str, Any]] = []
    result = provider.complete({"messages": user("x"), "stream": True}, make_ctx(on_delta=deltas.append))
    message = result["choices"][0]["message"]
    assert [c["id"] for c in message["tool_calls"]] == ["call_a", "call_b"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "北京"}
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"tz": "Asia/Shanghai"}
    assert result["choices"][0]["finish_reason"] == "tool_calls"
    assert sum("tool_calls" in d for d in deltas) > 4  # arguments really arrived in pieces
    assert deltas[-1] == {"index": 0, "finish_reason": "tool_calls"}


def test_a_stream_always_asks_for_its_usage_and_records_it(provider, server):
    usage = {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
    server.script(Reply(text="hi", usage=usage), Reply(text="hi", usage=usage))
    assert provider.complete({"messages": user("x"), "stream": True}, make_ctx())["usage"] == usage
    without = {"messages": user("x"), "stream": True, "stream_options": {"include_usage": False, "x": 1}}
    assert provider.complete(without, make_ctx())["usage"] == usage  # (budgets and limits count it)
    assert server.chat_requests[-1].body["stream_options"] == {"include_usage": True, "x": 1}


def test_non_streaming_records_usage_as_the_provider_returns_it(provider, server):
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_cache_hit_tokens": 1}
    server.script(Reply(text="hi", usage=usage))
    assert provider.complete({"messages": user("x")}, make_ctx())["usage"] == usage


def test_server_that_ignores_stream_true_still_yields_a_delta(provider, server):
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m"}
    body["choices"] = [
        {"index": 0, "message": {"role": "assistant", "content": "whole"}, "finish_reason": "stop"}
    ]
    server.script(Reply(body=body))
    deltas: list[dict[str, Any]] = []
    result = provider.complete({"messages": user("x"), "stream": True}, make_ctx(on_delta=deltas.append))
    assert result == body
    assert deltas == [{"index": 0, "content": "whole", "finish_reason": "stop"}]


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def test_stream_that_ends_without_done_still_completes(provider, server):
    server.script(Reply(events=[_chunk({"content": "par"}), _chunk({"content": "tial"}, "stop")], done=False))
    result = provider.complete({"messages": user("x"), "stream": True}, make_ctx())
    assert result["choices"][0]["message"]["content"] == "partial"
    assert result["choices"][0]["finish_reason"] == "stop"


def test_error_event_mid_stream_raises_provider_error(provider, server):
    error = {"error": {"message": "model overloaded", "type": "server_error", "code": 503}}
    server.script(Reply(events=[_chunk({"content": "Hel"}), error]))
    seen: list[dict[str, Any]] = []
    with pytest.raises(ProviderError, match="model overloaded") as info:
        provider.complete({"messages": user("x"), "stream": True}, make_ctx(on_delta=seen.append))
    assert (info.value.status, info.value.retryable) == (503, True)
    assert seen == [{"index": 0, "content": "Hel"}]


def test_garbage_chunk_is_a_non_retryable_provider_error(provider, server):
    server.script(Reply(events=["<html>proxy error</html>"]))
    err = _raises(provider, ProviderError, stream=True)
    assert not err.retryable and "not JSON" in str(err)


def test_a_failing_delta_sink_does_not_fail_the_call(provider):
    def broken(delta: dict[str, Any]) -> None:
        raise RuntimeError("redis down")

    result = provider.complete(
        {"messages": user("Reply exactly ok"), "stream": True}, make_ctx(on_delta=broken)
    )
    assert result["choices"][0]["message"]["content"] == "ok"


# --- errors --------------------------------------------------------------------------------------------


def test_429_is_retryable_with_retry_after_seconds(provider, server):
    server.script(Reply(status=429, headers={"Retry-After": "7"}, error="slow down"))
    err = _raises(provider, ProviderError)
    assert (err.status, err.retry_after, err.retryable) == (429, 7.0, True)
    assert "slow down" in str(err)
    assert err.to_wire()["details"]["retry_after"] == 7.0
    assert retry_delay(err, attempt=1) == 7.0


def test_429_retry_after_as_http_date(provider, server):
    when = email.utils.formatdate(time.time() + 120, usegmt=True)
    server.script(Reply(status=429, headers={"Retry-After": when}))
    err = _raises(provider, ProviderError)
    assert 100 < err.retry_after <= 121
    assert retry_delay(err, attempt=1, max_retry_after=60) is None  # two minutes is more than we wait


def test_500_is_retryable(provider, server):
    server.script(Reply(status=500, error="internal"))
    err = _raises(provider, ProviderError)
    assert (err.status, err.retryable, err.retry_after) == (500, True, None)
    assert err.type == "provider_error"


def test_408_and_503_are_retryable(provider, server):
    server.script(Reply(status=408), Reply(status=503))
    assert _raises(provider, ProviderError).retryable
    assert _raises(provider, ProviderError).retryable


def test_400_is_not_retryable_and_keeps_the_servers_message(provider, server):
    server.script(Reply(status=400, error="messages[0].content is required"))
    err = _raises(provider, ProviderError)
    assert (err.status, err.retryable) == (400, False)
    assert "messages[0].content is required" in str(err)
    assert retry_delay(err, attempt=1) is None


def test_dropped_connection_is_retryable(provider, server):
    server.script(Reply(drop=True))
    err = _raises(provider, ProviderError)
    assert err.retryable and err.status is None


def test_connection_refused_is_retryable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prov = OpenAICompatProvider(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, model="m")
    err = _raises(prov, ProviderError)
    assert err.retryable
    assert API_KEY not in str(err) and "Authorization" not in str(err)
    prov.close()


def test_slow_server_times_out_as_provider_timeout(provider, server):
    server.script(Reply(delay=10))
    start = time.monotonic()
    with pytest.raises(ProviderTimeout) as info:
        provider.complete({"messages": user("x")}, make_ctx(timeout=0.5))
    assert time.monotonic() - start < 2
    assert info.value.type == "provider_timeout" and info.value.retryable


def test_api_key_never_appears_in_error_text(provider, server):
    server.script(
        Reply(status=401, error=f"Incorrect API key provided: {API_KEY}. Authorization: Bearer {API_KEY}")
    )
    err = _raises(provider, ProviderError)
    for text in (str(err), repr(err), json.dumps(err.to_wire()), repr(provider)):
        assert API_KEY not in text
    assert err.status == 401 and not err.retryable


def test_a_secret_header_of_model_headers_never_appears_in_error_text(server):
    # (Azure-style "api-key: <key>" in model.headers instead of model.api_key; a gateway "Bearer" of its own)
    azure, bearer = "azk-" + "q" * 28, "gwtok-" + "z" * 20
    prov = OpenAICompatProvider(base_url=server.base_url, api_key=API_KEY, model="m",
                                headers={"api-key": azure, "X-Gateway-Authorization": f"Bearer {bearer}"})
    server.script(Reply(status=400, error=f"key {azure} rejected; token {bearer} unknown"))
    err = _raises(prov, ProviderError)
    assert azure not in str(err) and bearer not in str(err) and "***" in str(err)
    prov.close()


def test_wrong_key_is_a_non_retryable_401(server):
    prov = OpenAICompatProvider(base_url=server.base_url, api_key="sk-wrong-key-123", model="m")
    err = _raises(prov, ProviderError)
    assert (err.status, err.retryable) == (401, False)
    prov.close()


def test_a_401_says_when_the_key_came_from_an_unset_variable(server):
    prov = OpenAICompatProvider(base_url=server.base_url, api_key="", model="m", api_key_unset="DEEPSEEK_API_KEY")
    err = _raises(prov, ProviderError)
    assert err.status == 401
    assert "model.api_key reads ${DEEPSEEK_API_KEY}, which is not set in this worker's environment" in str(err)
    prov.close()


def test_missing_base_url_is_a_config_error():
    with pytest.raises(ConfigError):
        create(ModelSettings(provider="openai-compatible", api_key="x"))


# --- cancellation --------------------------------------------------------------------------------------


def test_cancel_mid_stream_ends_the_call_within_a_second(provider, server):
    release = threading.Event()
    server.script(
        Reply(text="Hello world, slowly", chunk_size=6, on_chunk=lambda i: i == 2 and release.wait(10))
    )
    ctx = make_ctx(call_id="cancel-mid-stream")
    cancelled_at: list[float] = []
    contents: list[str] = []

    def cancel() -> None:
        cancelled_at.append(time.monotonic())
        ctx.cancelled.set()

    def on_delta(delta: dict[str, Any]) -> None:
        if "content" in delta:
            contents.append(delta["content"])
            threading.Timer(0.2, cancel).start()  # the server is now stalled before the next chunk

    ctx.on_delta = on_delta
    try:
        with pytest.raises(CallCancelled):
            provider.complete({"messages": user("x"), "stream": True}, ctx)
        returned_after = time.monotonic() - cancelled_at[0]
        # The socket shutdown wakes the reader thread too: it ends while the server is still stalled.
        reader_gone = _wait_until(lambda: "llm-cancel-mid-stream" not in _thread_names(), 2.0)
    finally:
        release.set()
    assert contents == ["Hello "]
    assert returned_after < 2
    assert reader_gone
    # The provider is still usable afterwards (the aborted connection left the pool).
    result = provider.complete({"messages": user("Reply exactly ok")}, make_ctx())
    assert result["choices"][0]["message"]["content"] == "ok"


def _thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}


def _wait_until(predicate: Any, limit: float) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def test_cancel_while_waiting_for_response_headers(provider, server):
    server.script(Reply(delay=10))
    ctx = make_ctx()
    threading.Timer(0.2, ctx.cancelled.set).start()
    start = time.monotonic()
    with pytest.raises(CallCancelled):
        provider.complete({"messages": user("x"), "stream": True}, ctx)
    assert time.monotonic() - start < 2


def test_already_cancelled_call_sends_nothing(provider, server):
    ctx = make_ctx()
    ctx.cancelled.set()
    with pytest.raises(CallCancelled):
        provider.complete({"messages": user("x")}, ctx)
    assert server.chat_requests == []
