"""The Hermes agent plugin ``hermes-gateway`` (``hermes plugins enable hermes-gateway``): every gateway
tool the principal may call becomes a Hermes tool of the ``hermes-gateway`` toolset, run on our workers
with the agent's session, turn and tool-call ids; with ``route_llm`` the agent's chat-completions calls
go through the ``llm`` queue too. Settings: ``broker.settings.AgentPluginSettings``.
"""

from __future__ import annotations

from typing import Any

import structlog

from broker.errors import HermesError
from hermes_gateway.hermes_plugin.bridge import PLUGIN_NAME, TOOLSET, Bridge, Options

log = structlog.get_logger("hermes.plugin")

__all__ = ["PLUGIN_NAME", "TOOLSET", "Bridge", "Options", "register"]


def register(ctx: Any) -> None:
    """Hermes' plugin entry: register the gateway's tools and middleware on ``ctx``."""
    if not hasattr(type(ctx), "register_tool"):
        # Our own workers load the same plugins (shared config.yaml) with a middleware-only context;
        # routing their LLM calls back onto the queue would loop, so this plugin is agent-side only.
        return
    from broker.config import load_settings

    settings = load_settings()
    options = settings.agent_plugin
    if not options.url:
        log.warning(
            "hermes-gateway plugin: no gateway to reach; set HERMES_GATEWAY_URL or HERMES_REDIS_URL",
            plugin=PLUGIN_NAME,
        )
        return
    bridge = Bridge(options, settings)
    try:
        tools = bridge.tools()
    except HermesError as e:
        log.warning(f"hermes-gateway plugin: cannot list the gateway's tools: {e}", plugin=PLUGIN_NAME)
        bridge.close()
        return
    for name, schema in tools:
        ctx.register_tool(
            name=name,
            toolset=TOOLSET,
            schema=schema,
            handler=bridge.handler(name),
            description=schema.get("description", ""),
            emoji="🛰️",
        )
    import atexit

    atexit.register(bridge.close)  # the agent exiting cancels the calls it still waits on
    ctx.register_middleware("tool_execution", bridge.tool_execution)
    if options.route_llm:
        ctx.register_middleware("llm_execution", bridge.llm_execution)
