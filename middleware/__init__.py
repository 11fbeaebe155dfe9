"""The Hermes middleware contract (hermes.middleware.v1), self-contained: imports nothing else of ours.

Plugins are found and enabled as Hermes does it (``middleware.manifest``, ``middleware.plugin_config``),
so one HERMES_HOME serves the gateway and Hermes alike; ``PluginManager(home).load()`` imports the
enabled ones. A call reads ``manager.runtime`` (an immutable snapshot) once; ``ToolCallFlow`` and
``LLMCallFlow`` run it in the contract's order. Middleware and hooks fail open; an identical repeated
failure warns once, then goes to DEBUG until ``PluginManager.reload()``.
"""

from __future__ import annotations

from middleware.call_order import LLMCallFlow, ToolCallFlow
from middleware.context import PluginContext
from middleware.execution import ExecutionChain
from middleware.kinds import (
    API_REQUEST_ERROR,
    CONTEXT_FIELDS,
    KINDS,
    LLM_EXECUTION,
    LLM_REQUEST,
    MIDDLEWARE_SCHEMA_VERSION,
    POST_API_REQUEST,
    POST_TOOL_CALL,
    PRE_API_REQUEST,
    PRE_TOOL_CALL,
    TELEMETRY_SCHEMA_VERSION,
    TOOL_EXECUTION,
    TOOL_REQUEST,
    TRANSFORM_TOOL_RESULT,
    VALID_HOOKS,
)
from middleware.manifest import (
    ENTRY_POINTS_GROUP,
    PLAIN,
    Discovery,
    PlainDiscovery,
    PluginInfo,
    PluginManifest,
    resolve_home,
)
from middleware.plugin_config import (
    config_path,
    disable_plugin,
    enable_plugin,
    list_plugins,
    read_config,
)
from middleware.plugins import PluginManager
from middleware.reporter import FailureReporter
from middleware.requests import RequestOutcome
from middleware.runtime import MiddlewareRegistry, MiddlewareRuntime, Registration

__all__ = [
    "API_REQUEST_ERROR",
    "CONTEXT_FIELDS",
    "ENTRY_POINTS_GROUP",
    "KINDS",
    "LLM_EXECUTION",
    "LLM_REQUEST",
    "MIDDLEWARE_SCHEMA_VERSION",
    "POST_API_REQUEST",
    "POST_TOOL_CALL",
    "PRE_API_REQUEST",
    "PRE_TOOL_CALL",
    "TELEMETRY_SCHEMA_VERSION",
    "TOOL_EXECUTION",
    "TOOL_REQUEST",
    "TRANSFORM_TOOL_RESULT",
    "VALID_HOOKS",
    "PLAIN",
    "Discovery",
    "ExecutionChain",
    "FailureReporter",
    "LLMCallFlow",
    "MiddlewareRegistry",
    "MiddlewareRuntime",
    "PlainDiscovery",
    "PluginContext",
    "PluginInfo",
    "PluginManager",
    "PluginManifest",
    "Registration",
    "RequestOutcome",
    "ToolCallFlow",
    "config_path",
    "disable_plugin",
    "enable_plugin",
    "list_plugins",
    "read_config",
    "resolve_home",
]
