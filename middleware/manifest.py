"""Plugin discovery, as the real Hermes agent does it: ``plugin.yaml`` directories and entry points.

A directory plugin is ``<root>/<name>/plugin.yaml`` (or ``plugin.yml``) plus ``__init__.py`` with
``register(ctx)``; one category level is allowed (``<root>/<category>/<name>/``, key
``category/name``). Pip plugins expose the ``hermes_agent.plugins`` entry-point group.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from .logger import get_logger

log = get_logger()

ENTRY_POINTS_GROUP = "hermes_agent.plugins"
PLUGIN_KINDS = frozenset({"standalone", "backend", "exclusive", "platform", "model-provider"})


@dataclass(frozen=True)
class PluginManifest:
    """A parsed ``plugin.yaml`` (field names as in Hermes' ``PluginManifest``)."""

    name: str
    version: str = ""
    description: str = ""
    author: str = ""
    requires_env: list[Any] = field(default_factory=list)
    provides_tools: list[str] = field(default_factory=list)
    provides_hooks: list[str] = field(default_factory=list)
    source: str = ""  # "bundled" (extra dirs), "user" ($HERMES_HOME/plugins) or "entrypoint"
    path: str | None = None  # plugin directory, or the entry point's value
    kind: str = "standalone"
    key: str = ""  # what plugins.enabled / plugins.disabled match, besides the bare name
    error: str | None = None  # the manifest could not be read

    @property
    def lookup_key(self) -> str:
        """The registry key: path-derived for directories, the entry point name otherwise."""
        return self.key or self.name


@dataclass(frozen=True)
class PluginInfo:
    """What ``list_plugins`` and ``PluginManager.plugins()`` report about one plugin."""

    name: str
    source: str
    enabled: bool
    path: str | None
    description: str = ""
    error: str | None = None
    key: str = ""
    version: str = ""
    middleware: tuple[str, ...] = ()
    hooks: tuple[str, ...] = ()

    @classmethod
    def of(cls, m: PluginManifest, *, enabled: bool, error: str | None, ctx: Any = None) -> PluginInfo:
        """The report on ``m``; ``ctx``, its ``register(ctx)`` context, names what it registered."""
        return cls(
            name=m.name,
            source=m.source,
            enabled=enabled,
            path=m.path,
            description=m.description,
            error=error,
            key=m.lookup_key,
            version=m.version,
            middleware=tuple(ctx.middleware_registered) if ctx is not None else (),
            hooks=tuple(ctx.hooks_registered) if ctx is not None else (),
        )


class Discovery(Protocol):
    """The host's say on plugins (the gateway passes ``Settings.plugin_discovery``)."""

    @property
    def safe_mode(self) -> bool:
        """Load no plugin at all (``HERMES_SAFE_MODE``)."""
        ...

    @property
    def project_plugins(self) -> bool:
        """Look in ``./.hermes/plugins`` as well (``HERMES_ENABLE_PROJECT_PLUGINS``)."""
        ...

    def read_yaml(self, text: str) -> Any:
        """config.yaml parsed (raises ``yaml.YAMLError`` on bad YAML)."""
        ...


@dataclass(frozen=True)
class PlainDiscovery:
    """No switch on, config.yaml read as plain YAML: the default."""

    safe_mode: bool = False
    project_plugins: bool = False

    def read_yaml(self, text: str) -> Any:
        return yaml.safe_load(text)


PLAIN = PlainDiscovery()


def resolve_home(home: str | os.PathLike[str] | None = None) -> Path:
    """``home``, else ``$HERMES_HOME``, else ``~/.hermes`` (Hermes' own resolution order)."""
    if home is not None:
        return Path(home)
    env = os.environ.get("HERMES_HOME", "").strip()
    return Path(env) if env else Path.home() / ".hermes"


def _str_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _detect_kind(data: dict[str, Any], plugin_dir: Path) -> str:
    raw = data.get("kind", "standalone")
    kind = raw.strip().lower() if isinstance(raw, str) else "standalone"
    if kind not in PLUGIN_KINDS:
        log.warning(f"plugin {plugin_dir.name}: unknown kind {raw!r}; treating as 'standalone'")
        kind = "standalone"
    if kind == "standalone" and "kind" not in data:
        # Hermes routes undeclared memory providers to their own loader; so must we, or we'd run them.
        try:
            text = (plugin_dir / "__init__.py").read_text(errors="replace")[:8192]
        except OSError:  # no __init__.py: nothing to detect
            text = ""
        if "register_memory_provider" in text or "MemoryProvider" in text:
            kind = "exclusive"
        elif "register_provider" in text and "ProviderProfile" in text:
            kind = "model-provider"
    return kind


def parse_manifest(manifest_file: Path, plugin_dir: Path, source: str, prefix: str = "") -> PluginManifest:
    """Read one manifest; a broken one comes back with ``error`` set instead of raising."""
    try:
        data = yaml.safe_load(manifest_file.read_text(encoding="utf-8")) or {}
        if not isinstance(data, dict):
            raise ValueError("plugin.yaml must be a mapping")
    except (OSError, ValueError, yaml.YAMLError) as exc:
        log.warning(f"failed to parse {manifest_file}: {exc}")
        key = f"{prefix}/{plugin_dir.name}" if prefix else plugin_dir.name
        return PluginManifest(
            name=plugin_dir.name, source=source, path=str(plugin_dir), key=key, error=str(exc)
        )
    name = str(data.get("name") or plugin_dir.name)
    return PluginManifest(
        name=name,
        version=str(data.get("version") or ""),
        description=str(data.get("description") or ""),
        author=str(data.get("author") or ""),
        requires_env=_str_list(data.get("requires_env")),
        provides_tools=_str_list(data.get("provides_tools")),
        provides_hooks=_str_list(data.get("provides_hooks") or data.get("hooks")),
        source=source,
        path=str(plugin_dir),
        kind=_detect_kind(data, plugin_dir),
        key=f"{prefix}/{plugin_dir.name}" if prefix else name,
    )


def scan_directory(root: Path, source: str, prefix: str = "", depth: int = 0) -> list[PluginManifest]:
    """Manifests under ``root``: flat plugins, and one level of category directories."""
    found: list[PluginManifest] = []
    if not root.is_dir():
        return found
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.name.startswith((".", "__")):
            continue
        manifest_file = child / "plugin.yaml"
        if not manifest_file.exists():
            manifest_file = child / "plugin.yml"
        if manifest_file.exists():
            found.append(parse_manifest(manifest_file, child, source, prefix))
        elif depth == 0:
            found.extend(scan_directory(child, source, f"{prefix}/{child.name}" if prefix else child.name, 1))
    return found


def group_entry_points() -> list[importlib.metadata.EntryPoint]:
    """Entry points of the ``hermes_agent.plugins`` group."""
    try:
        return list(importlib.metadata.entry_points(group=ENTRY_POINTS_GROUP))
    except Exception as exc:  # a broken distribution must not stop discovery
        log.debug("entry-point scan failed", error=str(exc))
        return []


def scan_entry_points() -> list[PluginManifest]:
    """One manifest per entry point: name and key are the entry point's name, path its value."""
    found: list[PluginManifest] = []
    for ep in group_entry_points():
        dist = getattr(ep, "dist", None)
        meta = getattr(dist, "metadata", None)
        found.append(
            PluginManifest(
                name=ep.name,
                version=str(getattr(dist, "version", "") or ""),
                description=str(meta.get("Summary", "") or "") if meta is not None else "",
                source="entrypoint",
                path=ep.value,
                key=ep.name,
            )
        )
    return found


def discover(
    home: Path,
    extra_dirs: Iterable[str | os.PathLike[str]] = (),
    entry_points: bool = True,
    discovery: Discovery = PLAIN,
) -> dict[str, PluginManifest]:
    """Every plugin visible from ``home``, keyed by lookup key; later sources win on collision.

    As in Hermes: bundled (``extra_dirs``), user (``$HERMES_HOME/plugins``), project (``./.hermes/plugins``,
    with ``discovery.project_plugins``), then entry points; none with ``discovery.safe_mode``.
    """
    if discovery.safe_mode:
        log.info("HERMES_SAFE_MODE is set: plugin discovery skipped")
        return {}
    manifests: list[PluginManifest] = []
    for extra in extra_dirs:
        manifests.extend(scan_directory(Path(extra), "bundled"))
    manifests.extend(scan_directory(home / "plugins", "user"))
    if discovery.project_plugins:
        manifests.extend(scan_directory(Path.cwd() / ".hermes" / "plugins", "project"))
    if entry_points:
        manifests.extend(scan_entry_points())
    return {m.lookup_key: m for m in manifests}
