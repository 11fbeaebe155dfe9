"""``plugins.enabled`` / ``plugins.disabled`` in ``$HERMES_HOME/config.yaml``, in Hermes' own format.

Plugins are opt-in: only names in ``plugins.enabled`` load, and ``plugins.disabled`` always wins.
Both lists are written sorted, as ``hermes plugins enable|disable`` writes them, so one
HERMES_HOME serves the gateway and the Hermes agent alike. Every other key is preserved.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from middleware.manifest import PLAIN, Discovery, PluginInfo, PluginManifest, discover, resolve_home

_write_lock = threading.Lock()


def config_path(home: str | os.PathLike[str] | None = None) -> Path:
    """``$HERMES_HOME/config.yaml``."""
    return resolve_home(home) / "config.yaml"


def read_config(home: str | os.PathLike[str] | None = None, discovery: Discovery = PLAIN) -> dict[str, Any]:
    """The parsed config.yaml (by ``discovery.read_yaml``, the host's reader), or ``{}`` when it is missing
    or not a mapping."""
    path = config_path(home)
    try:
        data = discovery.read_yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def plugin_lists(config: dict[str, Any]) -> tuple[set[str] | None, set[str]]:
    """``(enabled, disabled)``; enabled is None when the key is missing or malformed (nothing enabled)."""
    section = config.get("plugins")
    if not isinstance(section, dict):
        return None, set()
    disabled_raw = section.get("disabled")
    disabled = {str(x) for x in disabled_raw} if isinstance(disabled_raw, list) else set()
    enabled_raw = section.get("enabled")
    enabled = {str(x) for x in enabled_raw} if isinstance(enabled_raw, list) else None
    return enabled, disabled


def is_enabled(manifest: PluginManifest, enabled: set[str] | None, disabled: set[str]) -> bool:
    """Hermes' rule: disabled (by key or name) wins; otherwise the key or name must be in enabled."""
    key = manifest.lookup_key
    if key in disabled or manifest.name in disabled:
        return False
    return enabled is not None and (key in enabled or manifest.name in enabled)


def _write_config(home: str | os.PathLike[str] | None, config: dict[str, Any]) -> None:
    path = config_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False)
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".yaml", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)  # atomic: a reader never sees half a config
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _resolve(name: str, manifests: Iterable[PluginManifest]) -> PluginManifest:
    """Match by key or manifest name, else by a unique leaf name (``nemo_relay`` → ``observability/nemo_relay``)."""
    manifests = list(manifests)
    for m in manifests:
        if name in (m.lookup_key, m.name):
            return m
    leaf = [m for m in manifests if m.lookup_key.split("/")[-1] == name]
    if len(leaf) == 1:
        return leaf[0]
    raise LookupError(f"plugin {name!r} is not installed (looked in {len(manifests)} discovered plugins)")


def _edit_lists(
    home: str | os.PathLike[str] | None, name: str, enable: bool, extra_dirs: Iterable[Any], discovery: Discovery
) -> str:
    manifest = _resolve(name, discover(resolve_home(home), extra_dirs, discovery=discovery).values())
    key = manifest.lookup_key
    with _write_lock:
        config = read_config(home, discovery)
        enabled, disabled = plugin_lists(config)
        enabled = set(enabled or ())
        bare = key.split("/")[-1]
        if enable:
            enabled.add(key)
            # Every alias must leave the deny-list, or "disabled wins" would veto this enable.
            disabled -= {key, bare, manifest.name}
        else:
            enabled -= {key, bare}
            disabled.add(key)
        section = config.get("plugins")
        section = section if isinstance(section, dict) else {}  # a malformed section is replaced
        config["plugins"] = {**section, "enabled": sorted(enabled), "disabled": sorted(disabled)}
        _write_config(home, config)
    return key


def enable_plugin(
    home: str | os.PathLike[str] | None, name: str, *, extra_dirs: Iterable[Any] = (), discovery: Discovery = PLAIN
) -> str:
    """Add a plugin to ``plugins.enabled`` (and drop it from ``disabled``); returns its key."""
    return _edit_lists(home, name, True, extra_dirs, discovery)


def disable_plugin(
    home: str | os.PathLike[str] | None, name: str, *, extra_dirs: Iterable[Any] = (), discovery: Discovery = PLAIN
) -> str:
    """Remove a plugin from ``plugins.enabled`` and add it to ``disabled``; returns its key."""
    return _edit_lists(home, name, False, extra_dirs, discovery)


def list_plugins(
    home: str | os.PathLike[str] | None = None, *, extra_dirs: Iterable[Any] = (), discovery: Discovery = PLAIN
) -> list[PluginInfo]:
    """Every discoverable plugin with its enabled state, without importing any of them."""
    home_path = resolve_home(home)
    enabled, disabled = plugin_lists(read_config(home_path, discovery))
    out: list[PluginInfo] = []
    for _key, m in sorted(discover(home_path, extra_dirs, discovery=discovery).items()):
        error = m.error
        init = Path(m.path or "") / "__init__.py"
        if error is None and m.source != "entrypoint" and m.path and not init.exists():
            error = f"no __init__.py in {m.path}"
        out.append(PluginInfo.of(m, enabled=is_enabled(m, enabled, disabled), error=error))
    return out
