"""The Hermes middleware contract (hermes.middleware.v1), self-contained: imports nothing else of ours.

Plugins
    A plugin is ``$HERMES_HOME/plugins/<name>/`` (``plugin.yaml`` + ``__init__.py`` defining
    ``register(ctx)``) or an entry point in the ``hermes_agent.plugins`` group, exactly as the Hermes
    agent finds them. Only plugins listed in ``plugins.enabled`` of ``$HERMES_HOME/config.yaml`` run
    (``plugins.disabled`` always wins), so one HERMES_HOME serves the gateway and Hermes alike::

        ctx.register_middleware("llm_request" | "llm_execution" | "tool_request" | "tool_execution", fn)
        ctx.register_hook("pre_tool_call" | "post_tool_call" | "transform_tool_result" | ..., fn)

    ``enable_plugin(home, name)``, ``disable_plugin(home, name)`` and ``list_plugins(home)`` edit and
    read that file; ``PluginManager(home).load()`` imports the enabled plugins and
    ``PluginManager.reload()`` re-imports them fresh (and resets the warn-once reporter). Each takes
    ``discovery=``, the host's say (Hermes' safe mode and project plugins, and how config.yaml is
    parsed; the gateway passes ``Settings.plugin_discovery``); by default ``PLAIN``: neither, plain YAML.

Calls (what the worker does)
    ``runtime = manager.runtime`` (or ``MiddlewareRegistry().runtime()``) is an immutable snapshot;
    read it once per call. When ``runtime.empty`` nothing is registered and the worker may call the
    executor/provider directly. Otherwise build the flows once and run each call through them::

        tools = ToolCallFlow(manager, coerce=..., check_available=..., policy=..., on_blocked=...)
        result = tools.run(tool_name, args, execute=lambda a: executor.run(spec, a, ctx), context={...})

        llm = LLMCallFlow(manager)
        response = llm.run(provider_kwargs, call_provider=lambda req: provider.call(req), context={...})

    ``context`` carries ``session_id``, ``task_id``, ``turn_id``, ``api_request_id``, ``tool_call_id``
    (tools) or ``provider``, ``model``, ``api_mode`` (LLM); missing ones are sent as "". The same
    steps are available piecemeal on the runtime: ``apply_tool_request(context, tool_name, args) ->
    (args, trace)``, ``apply_llm_request(context, request) -> (request, trace)``,
    ``run_tool_execution(context, tool_name, args, base, ...)``, ``run_llm_execution(context,
    request, base, ...)``, ``emit(hook_name, **payload) -> [results]``, and ``run_tool_call`` /
    ``run_llm_call`` (one-shot flows).

Failure rules
    Middleware and hooks fail open: logged through structlog (``hermes.middleware``) and skipped. An
    execution middleware raising after a successful ``next_call`` keeps the downstream result;
    ``next_call`` is single-use (a second call raises ``RuntimeError`` and runs nothing); downstream
    failures propagate (or are translated on purpose) and are never turned into a successful None.
    An identical repeated failure warns once, listing the fields the callback is given; repeats go
    to DEBUG until ``PluginManager.reload()``.
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
