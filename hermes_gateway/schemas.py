"""The model-facing view of the directory: OpenAI function tools, only those the principal may call."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from broker.directory import Entry
from broker.toolspec import ToolSpec
from workers.policy import Policy


def function_tool(spec: ToolSpec) -> dict[str, Any]:
    """One tool in the chat-completions ``tools`` shape."""
    parameters = dict(spec.input_schema)
    parameters.setdefault("type", "object")
    # Some providers refuse an object schema without ``properties``, even an empty one.
    parameters.setdefault("properties", {})
    return {
        "type": "function",
        "function": {"name": spec.name, "description": spec.description, "parameters": parameters},
    }


def tool_schemas(entries: Iterable[Entry], policy: Policy, principal: str | None = None) -> list[dict[str, Any]]:
    """Function tools for every spec ``policy`` lets ``principal`` call, sorted by name."""
    specs = sorted((e.spec for e in entries), key=lambda s: s.name)
    return [function_tool(s) for s in policy.allowed_tools(principal, specs)]
