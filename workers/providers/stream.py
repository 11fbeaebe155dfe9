"""Server-sent events in, one chat.completion out: the SSE line parser and the stream assembler."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

DONE = "[DONE]"

# Delta fields that are text pieces to concatenate (DeepSeek and vLLM stream reasoning separately).
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """Yield the data of each server-sent event; multi-line ``data:`` fields are joined with newlines."""
    buf: list[str] = []
    for line in lines:
        if line == "":
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            buf.append(value[1:] if value.startswith(" ") else value)
    if buf:
        yield "\n".join(buf)


def public_delta(index: int, fields: dict[str, Any], finish_reason: Any) -> dict[str, Any]:
    """The delta subscribers see of one choice: its index, text and tool-call pieces, finish reason."""
    out: dict[str, Any] = {"index": index}
    for key in ("content", "reasoning_content", "tool_calls"):
        if fields.get(key):
            out[key] = fields[key]
    if finish_reason:
        out["finish_reason"] = finish_reason
    return out


class _Choice:
    """Accumulates one choice's deltas."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.role = "assistant"
        self.text: dict[str, list[str]] = {}
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}
        self.finish_reason: str | None = None
        self.logprobs: Any = None

    def add(self, delta: dict[str, Any]) -> None:
        for key, value in delta.items():
            if key == "role":
                self.role = value or self.role
            elif key == "tool_calls":
                for tc in value or []:
                    self._add_tool_call(tc)
            elif key in _TEXT_FIELDS:
                if value is not None:
                    self.text.setdefault(key, []).append(str(value))
            elif value is not None:
                self.extra[key] = value

    def _add_tool_call(self, tc: dict[str, Any]) -> None:
        index = int(tc.get("index", len(self.tool_calls)))
        slot = self.tool_calls.setdefault(
            index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if tc.get("id"):
            slot["id"] = tc["id"]
        if tc.get("type"):
            slot["type"] = tc["type"]
        fn = tc.get("function") or {}
        name = fn.get("name")
        # OpenAI sends the name once; some servers resend it whole with every delta.
        if name and name != slot["function"]["name"]:
            slot["function"]["name"] += name
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": self.role, "content": None}
        msg.update({key: "".join(parts) for key, parts in self.text.items()})
        msg.update(self.extra)
        if self.tool_calls:
            msg["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return msg


class StreamAssembler:
    """Folds chat.completion.chunk objects into the chat.completion a non-streaming call would return."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.choices: dict[int, _Choice] = {}
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """Fold one chunk in; return the public deltas it carries (``{"index", "content"?, ...}``)."""
        for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if chunk.get(key) is not None and key not in self.head:
                self.head[key] = chunk[key]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for raw in chunk.get("choices") or []:
            index = int(raw.get("index", 0))
            if (choice := self.choices.get(index)) is None:
                choice = self.choices[index] = _Choice(index)
            delta = raw.get("delta") or {}
            choice.add(delta)
            if raw.get("logprobs") is not None:
                choice.logprobs = raw["logprobs"]
            if raw.get("finish_reason"):
                choice.finish_reason = raw["finish_reason"]
            public = public_delta(index, delta, raw.get("finish_reason"))
            if len(public) > 1:
                out.append(public)
        return out

    def result(self) -> dict[str, Any]:
        """The assembled chat.completion."""
        out: dict[str, Any] = {
            "id": self.head.get("id", ""),
            "object": "chat.completion",
            "created": self.head.get("created", 0),
            "model": self.head.get("model", ""),
        }
        for key in ("system_fingerprint", "service_tier"):
            if key in self.head:
                out[key] = self.head[key]
        out["choices"] = [
            {
                "index": c.index,
                "message": c.message(),
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
            }
            for c in (self.choices[i] for i in sorted(self.choices))
        ]
        if self.usage is not None:
            out["usage"] = self.usage
        return out
