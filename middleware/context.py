"""``PluginContext``: the ``ctx`` a plugin's ``register(ctx)`` receives."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .logger import get_logger

if TYPE_CHECKING:
    from middleware.runtime import MiddlewareRegistry

log = get_logger()


class PluginContext:
    """Registers a plugin's middleware and hooks, attributed to that plugin.

    Hermes' other ``register_*`` calls (tools, commands, ...) are ignored with a warning, so a Hermes
    plugin that also registers tools still loads and its middleware still runs.
    """

    def __init__(self, registry: MiddlewareRegistry, plugin: str, manifest: Any = None) -> None:
        self._registry = registry
        self.plugin_name = plugin
        self.manifest = manifest
        self.middleware_registered: list[str] = []
        self.hooks_registered: list[str] = []

    def register_middleware(self, kind: str, callback: Callable[..., Any]) -> None:
        """Register a behaviour-changing callback for ``kind`` (llm_request, llm_execution, ...)."""
        if self._registry.register_middleware(kind, callback, plugin=self.plugin_name):
            self.middleware_registered.append(kind)

    def register_hook(self, hook_name: str, callback: Callable[..., Any]) -> None:
        """Register an observer hook callback (pre_tool_call, post_api_request, ...)."""
        self._registry.register_hook(hook_name, callback, plugin=self.plugin_name)
        self.hooks_registered.append(hook_name)

    def __getattr__(self, name: str) -> Callable[..., None]:
        if not name.startswith("register_"):
            raise AttributeError(name)

        def ignore(*_args: Any, **_kwargs: Any) -> None:
            log.warning(
                f"plugin {self.plugin_name} called ctx.{name}(), which the gateway does not support; ignored",
                plugin=self.plugin_name,
                method=name,
            )

        return ignore
