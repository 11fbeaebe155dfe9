"""One typed settings object, loaded once from ``$HERMES_HOME/config.yaml`` and the environment."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .yamlload import load_yaml

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")

DEFAULT_LEASE = 30.0
DEFAULT_CONCURRENCY = 5
DEFAULT_QUEUE_SIZE = 10_000


def hermes_home(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``$HERMES_HOME`` or ``~/.hermes``."""
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("HERMES_HOME") or "~/.hermes").expanduser()


def expand_env(value: Any, environ: Mapping[str, str] | None = None) -> Any:
    """Replace ``${VAR}`` (and ``${VAR:-default}``) in every string, so secrets stay out of files."""
    env = os.environ if environ is None else environ
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m.group(1), m.group(2) if m.group(2) is not None else ""), value)
    if isinstance(value, dict):
        return {k: expand_env(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, env) for v in value]
    return value


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ConfigError(f"{name}: expected a number, got {raw!r}") from e


@dataclass(frozen=True)
class Settings:
    """Every setting the gateway reads. Environment variables override the file."""

    home: Path
    redis_url: str | None = None
    log_level: str = "INFO"
    log_format: str = "console"
    lease: float = DEFAULT_LEASE
    max_attempts: int = 3
    result_ttl: int = 86400
    queues: tuple[str, ...] = ("tools", "llm")
    executors: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] = field(default_factory=dict)
    plugins: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    mcp: dict[str, Any] = field(default_factory=dict)
    audit: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def tools_dir(self) -> Path:
        return self.home / "tools"

    @property
    def plugins_dir(self) -> Path:
        return self.home / "plugins"

    @property
    def config_path(self) -> Path:
        return self.home / "config.yaml"

    def executor_settings(self, kind: str) -> dict[str, Any]:
        """``executors.<kind>`` merged over ``executor`` (the seed writes both spellings)."""
        base = dict(self.raw.get("executor") or {})
        if kind == "mcp":
            base.update(self.mcp)  # the seed's `mcp.handshake_timeout` lives at the top level
        base.update(self.executors.get(kind) or {})
        return base

    def concurrency_for(self, kind: str) -> int:
        return int(self.executor_settings(kind).get("concurrency", DEFAULT_CONCURRENCY))

    def queue_size_for(self, kind: str) -> int:
        return int(self.executor_settings(kind).get("queue_size", DEFAULT_QUEUE_SIZE))


def load_settings(home: str | os.PathLike[str] | None = None) -> Settings:
    """Read ``config.yaml`` (if any), expand ``${VAR}``, apply ``HERMES_*`` overrides."""
    root = hermes_home(home)
    path = root / "config.yaml"
    raw: dict[str, Any] = {}
    if path.exists():
        try:
            loaded = load_yaml(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        raw = expand_env(loaded)
    broker = raw.get("broker") or {}
    logging_cfg = raw.get("logging") or {}
    workers = raw.get("workers") or {}
    return Settings(
        home=root,
        redis_url=os.environ.get("HERMES_REDIS_URL") or broker.get("url") or None,
        log_level=str(os.environ.get("HERMES_LOG_LEVEL") or logging_cfg.get("level") or "INFO").upper(),
        log_format=str(os.environ.get("HERMES_LOG_FORMAT") or logging_cfg.get("format") or "console"),
        lease=_env_float("HERMES_LEASE", float(workers.get("lease", DEFAULT_LEASE))),
        max_attempts=int(_env_float("HERMES_MAX_ATTEMPTS", float(workers.get("max_attempts", 3)))),
        result_ttl=int(_env_float("HERMES_RESULT_TTL", float(workers.get("result_ttl", 86400)))),
        executors=dict(raw.get("executors") or {}),
        policy=dict(raw.get("policy") or {}),
        plugins=dict(raw.get("plugins") or {}),
        model=dict(raw.get("model") or {}),
        mcp=dict(raw.get("mcp") or {}),
        audit=dict(raw.get("audit") or {}),
        raw=raw,
    )
