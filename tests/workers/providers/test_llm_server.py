"""The test server itself behaves like an OpenAI-compatible endpoint others can rely on."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.llm_server import LLMServer, Reply, default_rule


def _say(text, **body):
    return {"messages": [{"role": "user", "content": text}], **body}


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_default_rule_answers_reply_exactly():
    assert default_rule(_say("Reply exactly ok")).text == "ok"
    assert default_rule(_say('Please reply exactly: "pong"')).text == "pong"


def test_default_rule_calls_get_weather_only_when_offered():
    call = default_rule(_say("What's the weather in San Francisco?", tools=WEATHER)).tool_calls
    assert call == [{"name": "get_weather", "arguments": {"city": "San Francisco"}}]
    assert default_rule(_say("北京的天气怎么样", tools=WEATHER)).tool_calls[0]["arguments"] == {
        "city": "北京"
    }
    assert default_rule(_say("weather in Paris")).tool_calls is None


def test_default_rule_answers_with_the_tool_result():
    body = {
        "messages": [
            {"role": "user", "content": "weather in Paris"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "sunny, 21C"},
        ]
    }
    assert "sunny, 21C" in default_rule(body).text


def test_models_scripting_and_recording_over_http():
    with LLMServer(rule=lambda body: {"text": "from rule"} if "rule" in json.dumps(body) else None) as srv:
        models = httpx.get(f"{srv.base_url}/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "hermes-test"
        httpx.post(f"{srv.url}/_script", json=[{"text": "scripted"}])
        first = httpx.post(f"{srv.base_url}/chat/completions", json=_say("use the rule")).json()
        second = httpx.post(f"{srv.base_url}/chat/completions", json=_say("use the rule")).json()
        third = httpx.post(f"{srv.base_url}/chat/completions", json=_say("hi")).json()
        assert [r["choices"][0]["message"]["content"] for r in (first, second, third)] == [
            "scripted",
            "from rule",
            "echo: hi",
        ]
        recorded = httpx.get(f"{srv.url}/_requests").json()
        assert [r["path"] for r in recorded][-3:] == ["/v1/chat/completions"] * 3
        assert len(srv.chat_requests) == 3


def test_unknown_reply_fields_are_rejected():
    with pytest.raises(ValueError, match="unknown reply fields"):
        Reply.from_dict({"txt": "typo"})


def test_standalone_process_serves_a_script(tmp_path):
    script = tmp_path / "replies.json"
    script.write_text(json.dumps([{"text": "from the script"}]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.llm_server", "--port", "0", "--script", str(script)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        base_url = line.split()[-1]
        reply = httpx.post(f"{base_url}/chat/completions", json=_say("x"), timeout=5).json()
        assert reply["choices"][0]["message"]["content"] == "from the script"
    finally:
        proc.terminate()
        proc.wait(5)
