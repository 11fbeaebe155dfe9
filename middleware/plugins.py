"""``PluginManager``: discovers enabled plugins under a HERMES_HOME, imports them, runs ``register(ctx)``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from middleware.logger import get_logger
from middleware.manifest import (
    ENTRY_POINTS_GROUP,
    PLAIN,
    Discovery,
    PluginInfo,
    PluginManifest,
    discover,
    group_entry_points,
    resolve_home,
)
from middleware.plugin_config import is_enabled, plugin_lists, read_config
from middleware.reporter import FailureReporter
from middleware.runtime import MiddlewareRegistry, MiddlewareRuntime

log = get_logger()

# Directory plugins import as hermes_plugins.<slug>, the namespace Hermes uses, so relative imports
# inside a plugin package work the same under both runtimes.
NAMESPACE = "hermes_plugins"


def _slug(key: str) -> str:
    return key.replace("/", "__").replace("-", "_")


def _import_directory_plugin(manifest: PluginManifest) -> types.ModuleType:
    plugin_dir = Path(manifest.path or "")
    init_file = plugin_dir / "__init__.py"
    if not init_file.exists():
        raise FileNotFoundError(f"No __init__.py in {plugin_dir}")
    if NAMESPACE not in sys.modules:
        ns = types.ModuleType(NAMESPACE)
        ns.__path__ = []  # type: ignore[attr-defined]
        ns.__package__ = NAMESPACE
        sys.modules[NAMESPACE] = ns
    module_name = f"{NAMESPACE}.{_slug(manifest.lookup_key)}"
    spec = importlib.util.spec_from_file_location(
        module_name, init_file, submodule_search_locations=[str(plugin_dir)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"Cannot create module spec for {init_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _import_entrypoint_plugin(manifest: PluginManifest) -> Any:
    for ep in group_entry_points():
        if ep.name == manifest.name:
            return ep.load()
    raise ImportError(f"Entry point {manifest.name!r} not found in group '{ENTRY_POINTS_GROUP}'")


def _module_names(manifest: PluginManifest) -> str:
    if manifest.source == "entrypoint":
        return (manifest.path or "").split(":", 1)[0].strip()
    return f"{NAMESPACE}.{_slug(manifest.lookup_key)}"


def _purge(names: Iterable[str]) -> None:
    """Drop plugin modules (and their submodules) so the next import reads the files again."""
    for name in names:
        if not name:
            continue
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            sys.modules.pop(mod, None)
    importlib.invalidate_caches()


class PluginManager:
    """Loads the plugins enabled in ``$HERMES_HOME/config.yaml``; ``runtime`` is what calls run through.

    ``reload()`` re-imports every plugin from disk, swaps in a fresh runtime (calls in flight finish on
    the old one) and resets the warn-once reporter. ``extra_dirs`` are scanned like Hermes' bundled dir.
    """

    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        *,
        extra_dirs: Iterable[str | os.PathLike[str]] = (),
        entry_points: bool = True,
        discovery: Discovery = PLAIN,
    ) -> None:
        self.home = resolve_home(home)
        self.extra_dirs = tuple(Path(d) for d in extra_dirs)
        self.entry_points = entry_points
        self.discovery = discovery
        self.reporter = FailureReporter()
        self._registry = MiddlewareRegistry(self.reporter)
        self._plugins: dict[str, PluginInfo] = {}
        self._modules: set[str] = set()
        self._loaded = False
        self._lock = threading.Lock()

    @property
    def runtime(self) -> MiddlewareRuntime:
        """The current runtime snapshot (empty until ``load()``)."""
        return self._registry.runtime()

    @property
    def registry(self) -> MiddlewareRegistry:
        """The registry the loaded plugins registered into."""
        return self._registry

    def plugins(self) -> list[PluginInfo]:
        """What the last load found: enabled and loaded, skipped, or failed (with ``error``)."""
        return [self._plugins[k] for k in sorted(self._plugins)]

    def load(self) -> list[PluginInfo]:
        """Discover and load enabled plugins once; later calls return the same result."""
        with self._lock:
            if not self._loaded:
                self._load_locked(fresh=False)
        return self.plugins()

    def reload(self) -> list[PluginInfo]:
        """Re-import every plugin fresh and reset the warn-once reporter."""
        with self._lock:
            self._load_locked(fresh=True)
        return self.plugins()

    def _load_locked(self, fresh: bool) -> None:
        if fresh:
            _purge(self._modules)
            self._modules.clear()
        manifests = discover(self.home, self.extra_dirs, self.entry_points, self.discovery)
        enabled, disabled = plugin_lists(read_config(self.home, self.discovery))
        registry = MiddlewareRegistry(self.reporter)
        infos: dict[str, PluginInfo] = {}
        for key, manifest in manifests.items():
            skip = self._skip_reason(manifest, enabled, disabled)
            if skip is not None:
                infos[key] = PluginInfo.of(manifest, enabled=False, error=skip)
                log.debug("plugin skipped", plugin=key, reason=skip)
                continue
            infos[key] = self._load_one(manifest, registry)
        # Swap in one step: a concurrent call sees either the old plugins or the new ones, never half.
        self._registry = registry
        self._plugins = infos
        self._loaded = True
        if fresh:
            self.reporter.reset()
        loaded = sorted(k for k, i in infos.items() if i.enabled)
        log.info("plugins loaded", home=str(self.home), found=len(infos), enabled=loaded)

    @staticmethod
    def _skip_reason(m: PluginManifest, enabled: set[str] | None, disabled: set[str]) -> str | None:
        key = m.lookup_key
        if m.error is not None:
            return m.error
        if key in disabled or m.name in disabled:
            return "disabled via config"
        if m.kind == "exclusive":
            return "exclusive plugin — activate via <category>.provider config"
        if m.kind in ("model-provider", "platform"):
            return f"{m.kind} plugin — not run by the gateway"
        if not is_enabled(m, enabled, disabled):
            # (the gateway's command: this loader runs in its workers; the Hermes agent's own is `hermes`)
            return f"not enabled in config (run `hermes-gateway plugins enable {key}` to activate)"
        return None

    def _load_one(self, manifest: PluginManifest, registry: MiddlewareRegistry) -> PluginInfo:
        key = manifest.lookup_key
        self._modules.add(_module_names(manifest))
        importer = _import_entrypoint_plugin if manifest.source == "entrypoint" else _import_directory_plugin
        try:
            module = importer(manifest)
        except Exception as exc:
            log.warning(f"failed to load plugin {key!r}: {exc}", plugin=key, error=str(exc), exc_info=exc)
            return PluginInfo.of(manifest, enabled=False, error=str(exc))
        register = getattr(module, "register", None)
        if not callable(register):
            log.warning(f"plugin {key!r} has no register() function", plugin=key)
            return PluginInfo.of(manifest, enabled=False, error="no register() function")
        ctx = registry.context(key, manifest)
        try:
            register(ctx)
        except Exception as exc:
            # As in Hermes, what register() added before failing stays registered.
            log.warning(f"plugin {key!r} register() raised: {exc}", plugin=key, error=str(exc), exc_info=exc)
            return PluginInfo.of(manifest, enabled=False, error=str(exc), ctx=ctx)
        log.debug(
            "plugin loaded", plugin=key, middleware=ctx.middleware_registered, hooks=ctx.hooks_registered
        )
        return PluginInfo.of(manifest, enabled=True, error=None, ctx=ctx)
