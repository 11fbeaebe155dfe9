"""The contract's vocabulary: schema versions, middleware kinds, hook names and payload builders."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TELEMETRY_SCHEMA_VERSION = "hermes.observer.v1"
MIDDLEWARE_SCHEMA_VERSION = "hermes.middleware.v1"

LLM_REQUEST = "llm_request"
LLM_EXECUTION = "llm_execution"
TOOL_REQUEST = "tool_request"
TOOL_EXECUTION = "tool_execution"

KINDS: tuple[str, ...] = (LLM_REQUEST, LLM_EXECUTION, TOOL_REQUEST, TOOL_EXECUTION)

# The payload key each kind rewrites or passes to next_call.
PAYLOAD_KEY: dict[str, str] = {
    LLM_REQUEST: "request",
    LLM_EXECUTION: "request",
    TOOL_REQUEST: "args",
    TOOL_EXECUTION: "args",
}

# Observer hooks the gateway fires; the names are the real Hermes agent's (hermes_cli.plugins.VALID_HOOKS).
PRE_TOOL_CALL = "pre_tool_call"
POST_TOOL_CALL = "post_tool_call"
TRANSFORM_TOOL_RESULT = "transform_tool_result"
PRE_API_REQUEST = "pre_api_request"
POST_API_REQUEST = "post_api_request"
API_REQUEST_ERROR = "api_request_error"

# Every name Hermes 0.19 accepts, so a Hermes plugin registering e.g. on_session_start is not warned about.
VALID_HOOKS: frozenset[str] = frozenset(
    {
        PRE_TOOL_CALL,
        POST_TOOL_CALL,
        "transform_terminal_output",
        TRANSFORM_TOOL_RESULT,
        "transform_llm_output",
        "pre_llm_call",
        "post_llm_call",
        "pre_verify",
        PRE_API_REQUEST,
        POST_API_REQUEST,
        API_REQUEST_ERROR,
        "on_session_start",
        "on_session_end",
        "on_session_finalize",
        "on_session_reset",
        "subagent_start",
        "subagent_stop",
        "pre_gateway_dispatch",
        "pre_approval_request",
        "post_approval_response",
        "kanban_task_claimed",
        "kanban_task_completed",
        "kanban_task_blocked",
    }
)

# Runtime context each call family always carries ("" when unknown, as Hermes sends it), so a
# callback reading kwargs["turn_id"] never fails just because the caller had no turn. The contract's list
# (session_id, task_id, turn_id, api_request_id, provider, model, api_mode, tool_name; tool_call_id where it
# applies) reaches every callback: a tool call's provider, model and api_mode are its agent's, when given.
TOOL_CONTEXT_FIELDS: tuple[str, ...] = (
    "session_id", "task_id", "turn_id", "api_request_id", "provider", "model", "api_mode", "tool_call_id",
)
LLM_CONTEXT_FIELDS: tuple[str, ...] = (
    "session_id",
    "task_id",
    "turn_id",
    "api_request_id",
    "platform",
    "provider",
    "model",
    "base_url",
    "api_mode",
    "tool_name",
)
CONTEXT_FIELDS: tuple[str, ...] = (*LLM_CONTEXT_FIELDS, "api_call_count", "tool_name", "tool_call_id")


def normalize_context(context: Mapping[str, Any] | None, fields: tuple[str, ...]) -> dict[str, Any]:
    """Return a fresh context dict with every field of ``fields`` present (None becomes "")."""
    out: dict[str, Any] = dict(context) if context else {}
    for name in fields:
        if out.get(name) is None:
            out[name] = ""
    return out


def middleware_payload(context: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """Build a middleware payload: context, the kind's own fields, and both schema versions."""
    payload = {**context, **fields}
    payload["telemetry_schema_version"] = TELEMETRY_SCHEMA_VERSION
    payload["middleware_schema_version"] = MIDDLEWARE_SCHEMA_VERSION
    return payload


def trace_entry(result: dict[str, Any]) -> dict[str, Any]:
    """A request middleware's non-empty ``source``/``reason``/``name`` as one ``middleware_trace`` entry,
    as Hermes stores it; ``{"source": "plugin"}`` when it returned none of them."""
    entry: dict[str, Any] = {}
    for key in ("source", "reason", "name"):
        value = result.get(key)
        if isinstance(value, str) and value:
            entry[key] = value
    return entry or {"source": "plugin"}
