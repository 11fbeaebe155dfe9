"""What the test server answers: canned replies, the default rule, and the completion / chunk shapes."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Reply:
    """One canned answer. ``on_chunk(i)`` (in-process only) runs before stream chunk ``i`` is sent."""

    text: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # [{"name", "arguments": dict | str, "id"?}]
    status: int = 200
    error: str | None = None  # the error message when status >= 400
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # before the response headers
    chunk_delay: float = 0.0  # before every stream chunk after the first
    chunk_size: int = 8  # characters per streamed text or arguments piece
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    body: dict[str, Any] | None = None  # sent verbatim (status 200, JSON), ignoring stream
    drop: bool = False  # close the connection without answering
    events: list[Any] | None = None  # stream these SSE data payloads (dict -> JSON, str verbatim) instead
    done: bool = True  # end the stream with "data: [DONE]"
    on_chunk: Callable[[int], None] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reply:
        """Build from a script entry; unknown keys are an error so typos do not pass silently."""
        names = {f.name for f in fields(cls)} - {"on_chunk"}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown reply fields: {sorted(unknown)}")
        return cls(**data)


Rule = Callable[[dict[str, Any]], "Reply | dict[str, Any] | None"]


# --- the default "model" --------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _offered_tools(body: dict[str, Any]) -> set[str]:
    return {
        str((t.get("function") or {}).get("name") or t.get("name"))
        for t in body.get("tools") or []
        if isinstance(t, dict)
    }


def default_rule(body: dict[str, Any]) -> Reply:
    """The predictable model described in the module docstring."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    if last.get("role") == "tool":
        return Reply(text=f"Tool result: {_text_of(last.get('content'))}")
    user: dict[str, Any] = next((m for m in reversed(messages) if m.get("role") == "user"), {})
    text = _text_of(user.get("content"))
    exact = re.search(r"reply exactly[:\s]+(.+)", text, re.IGNORECASE | re.DOTALL)
    if exact:
        return Reply(text=exact.group(1).strip().strip("\"'"))
    city = re.search(r"weather (?:in|for|of) ([^?.!,\n]+)", text, re.IGNORECASE) or re.search(
        r"(\S+?)的天气", text
    )
    if city:
        name = city.group(1).strip()
        # (an MCP client names a server's tool mcp__<server>__<tool>, as the Hermes agent does)
        weather = sorted(t for t in _offered_tools(body) if t == "get_weather" or t.endswith("__get_weather"))
        if weather:
            return Reply(tool_calls=[{"name": weather[0], "arguments": {"city": name}}])
        return Reply(text=f"I have no weather tool, so I cannot tell the weather in {name}.")
    return Reply(text=f"echo: {text}")


# --- response shapes ------------------------------------------------------------------------------


def _words(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).split()) if value else 0


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    out = []
    for n, tc in enumerate(reply.tool_calls or []):
        fn = tc.get("function") or tc
        args = fn.get("arguments", {})
        out.append(
            {
                "id": tc.get("id") or f"call_{uuid.uuid4().hex[:12]}_{n}",
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    return out


def _pieces(text: str, size: int) -> list[str]:
    size = max(1, size)
    return [text[i : i + size] for i in range(0, len(text), size)]


class Answer:
    """The completion one reply produces for one request, as a whole or as chunks."""

    def __init__(self, reply: Reply, body: dict[str, Any], model: str) -> None:
        self.reply = reply
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = str(body.get("model") or model)
        self.calls = _tool_calls(reply)
        self.text = reply.text if reply.text is not None else ("" if not self.calls else None)
        self.finish = reply.finish_reason or ("tool_calls" if self.calls else "stop")
        prompt = _words(body.get("messages"))
        completion = _words(self.text) + _words(self.calls)
        self.usage = reply.usage or {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = self.calls
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish}
        return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage}

    def chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}

        size = self.reply.chunk_size
        out = [chunk({"role": "assistant", "content": "" if self.text is not None else None})]
        out += [chunk({"content": piece}) for piece in _pieces(self.text or "", size)]
        for i, call in enumerate(self.calls):
            fn = call["function"]
            first = {"index": i, "id": call["id"], "type": "function"}
            out.append(chunk({"tool_calls": [{**first, "function": {"name": fn["name"], "arguments": ""}}]}))
            for piece in _pieces(fn["arguments"], size):
                out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
        out.append(chunk({}, self.finish))
        if include_usage:
            out.append({**self._head("chat.completion.chunk"), "choices": [], "usage": self.usage})
        return out
