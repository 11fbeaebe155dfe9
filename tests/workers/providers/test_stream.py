"""SSE parsing and folding chunks into one chat.completion."""

from __future__ import annotations

from workers.providers.stream import StreamAssembler, sse_data


def test_sse_data_joins_multiline_events_and_skips_comments():
    lines = [": keep-alive", 'data: {"a":', "data: 1}", "", "event: x", "data:[DONE]", ""]
    assert list(sse_data(lines)) == ['{"a":\n1}', "[DONE]"]


def test_sse_data_flushes_a_last_event_without_blank_line():
    assert list(sse_data(["data: x"])) == ["x"]


def _chunk(delta, index=0, finish=None, **head):
    return {
        "id": "c1",
        "created": 5,
        "model": "m",
        **head,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }


def test_interleaved_tool_call_deltas_are_assembled_by_index():
    asm = StreamAssembler()
    asm.add(_chunk({"role": "assistant", "content": None}))
    asm.add(
        _chunk(
            {
                "tool_calls": [
                    {"index": 1, "id": "b", "type": "function", "function": {"name": "two", "arguments": ""}}
                ]
            }
        )
    )
    asm.add(
        _chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "one", "arguments": '{"x"'}}]})
    )
    asm.add(_chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}))
    asm.add(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}))
    asm.add(_chunk({}, finish="tool_calls"))
    msg = asm.result()["choices"][0]["message"]
    assert msg["content"] is None
    assert msg["tool_calls"] == [
        {"id": "a", "type": "function", "function": {"name": "one", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "two", "arguments": "{}"}},
    ]


def test_a_name_resent_with_every_delta_is_not_doubled():
    asm = StreamAssembler()
    for piece in ('{"c', 'ity": 1}'):
        asm.add(
            _chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "a", "function": {"name": "get_weather", "arguments": piece}}
                    ]
                }
            )
        )
    call = asm.result()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": 1}'}


def test_text_reasoning_finish_usage_and_public_deltas():
    asm = StreamAssembler()
    out = []
    out += asm.add(_chunk({"role": "assistant", "content": ""}, system_fingerprint="fp"))
    out += asm.add(_chunk({"reasoning_content": "think"}))
    out += asm.add(_chunk({"content": "Hel"}))
    out += asm.add(_chunk({"content": "lo"}, finish="stop"))
    out += asm.add({"id": "c1", "choices": [], "usage": {"total_tokens": 3}})
    result = asm.result()
    assert (
        result["id"] == "c1"
        and result["system_fingerprint"] == "fp"
        and result["object"] == "chat.completion"
    )
    assert result["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello",
        "reasoning_content": "think",
    }
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"] == {"total_tokens": 3}
    assert out == [
        {"index": 0, "reasoning_content": "think"},
        {"index": 0, "content": "Hel"},
        {"index": 0, "content": "lo", "finish_reason": "stop"},
    ]


def test_several_choices_stay_apart():
    asm = StreamAssembler()
    asm.add(_chunk({"content": "a"}, index=1))
    asm.add(_chunk({"content": "b"}, index=0))
    assert [c["message"]["content"] for c in asm.result()["choices"]] == ["b", "a"]
