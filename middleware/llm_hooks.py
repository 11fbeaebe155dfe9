"""The LLM observer hooks' payload fields, shaped as the real Hermes agent builds them, so a Hermes
observer plugin runs unchanged in our workers. Hooks get copies: writing to one never reaches the provider.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from middleware.requests import safe_copy

# Provider kwargs that configure the HTTP client rather than the request (Hermes drops them too).
_CLIENT_ONLY = frozenset({"timeout", "http_client"})


def request_view(request: Mapping[str, Any]) -> dict[str, Any]:
    """``{"method": "POST", "body": <the provider kwargs, copied>}``, the request hooks are given."""
    body = {k: v for k, v in request.items() if k not in _CLIENT_ONLY}
    return {"method": "POST", "body": safe_copy(body)}


def _messages(request: Mapping[str, Any]) -> list[Any]:
    for key in ("messages", "input"):
        value = request.get(key)
        if isinstance(value, list):
            return value
    return []


def _last_user_message(messages: list[Any]) -> Any:
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return message.get("content") or ""
    return ""


def pre_api_fields(request: Mapping[str, Any]) -> dict[str, Any]:
    """``pre_api_request``'s fields besides the context, from the effective request."""
    messages = safe_copy(_messages(request))
    tools = request.get("tools")
    chars = sum(len(str(m)) for m in messages)
    return {
        "request": request_view(request),
        "user_message": _last_user_message(messages),
        "conversation_history": list(messages),
        "request_messages": list(messages),
        "message_count": len(messages),
        "tool_count": len(tools) if isinstance(tools, list) else 0,
        "approx_input_tokens": chars // 4,
        "request_char_count": chars,
        "max_tokens": request.get("max_tokens") or request.get("max_completion_tokens"),
    }


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, Mapping) else getattr(value, key, None)


def _plain(value: Any) -> Any:
    """SDK objects (pydantic models) as plain data; anything else as it is."""
    dump = getattr(value, "model_dump", None)
    return dump() if callable(dump) else value


def post_api_fields(request: Mapping[str, Any], response: Any, extra: Mapping[str, Any]) -> dict[str, Any]:
    """``post_api_request``'s fields besides the context: a summary of the response, not the raw object."""
    choices = _get(response, "choices") or []
    first = choices[0] if isinstance(choices, list) and choices else None
    message = _get(first, "message") or {}
    tool_calls = _plain(_get(message, "tool_calls")) or []
    content = _get(message, "content")
    finish_reason = extra.get("finish_reason", _get(first, "finish_reason"))
    usage = extra.get("usage", _plain(_get(response, "usage")))
    assistant = {"role": _get(message, "role") or "assistant", "content": content, "tool_calls": tool_calls}
    return {
        **extra,
        "finish_reason": finish_reason,
        "message_count": len(_messages(request)),
        "response_model": _get(response, "model"),
        "response": safe_copy(
            {
                "model": _get(response, "model"),
                "finish_reason": finish_reason,
                "assistant_message": assistant,
                "usage": usage,
            }
        ),
        "usage": safe_copy(usage),
        "assistant_message": safe_copy(assistant),
        "assistant_content_chars": len(content) if isinstance(content, str) else 0,
        "assistant_tool_call_count": len(tool_calls) if isinstance(tool_calls, list) else 0,
    }
