"""An llm_execution middleware's view of a provider response (``workers.llm.as_response``)."""

from __future__ import annotations

from workers.llm import as_response


def test_a_response_reads_by_key_and_by_attribute_and_has_no_sdk_methods() -> None:
    r = as_response({"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
    assert r["choices"][0]["message"]["content"] == r.choices[0].message.content == "ok"
    assert r.choices[0].message.tool_calls is None  # (a field it lacks reads None, as the SDK's optional ones)
    # plugins normalise with `if hasattr(resp, "model_dump"): resp = resp.model_dump()`: plain data has none
    assert not any(hasattr(r, m) for m in ("model_dump", "to_dict", "json", "_private", "__deepcopy__"))
