"""One typed settings object, loaded once from ``$HERMES_HOME/config.yaml`` and the environment."""

from __future__ import annotations

import functools
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
# The ``${VAR}`` / ``${VAR:-default}`` grammar of :func:`expand_env`, for code that expands with it (tool
# specs, on the worker) and must first tell which references have no value.
ENV_VAR = _VAR

DEFAULT_LEASE = 30.0
DEFAULT_CONCURRENCY = 5
DEFAULT_QUEUE_SIZE = 10_000
DEFAULT_WAIT_TIMEOUT_MS = 500
# Bytes a call's arguments (an LLM call's request) may take, packed: what the broker keeps for a day.
# The HTTP API's body limit (HERMES_API_MAX_BODY) has the same default.
DEFAULT_MAX_ARGS = 32 * 1024 * 1024
MAX_ARGS_ENV = "HERMES_MAX_ARGS"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


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


def unset_env(text: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Names of the ``${VAR}`` references in ``text`` that :func:`expand_env` would have to leave empty:
    the variable is not set and the reference gives no ``:-default``."""
    env = os.environ if environ is None else environ
    return [m.group(1) for m in _VAR.finditer(text) if m.group(2) is None and m.group(1) not in env]


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
    # redis-py's private insides for hot pipelines and pub/sub reads on a plain Redis (broker/pipes.py,
    # Gateway._read_direct): ``broker.fast_path`` / HERMES_REDIS_FAST_PATH, default measured (ARCHITECTURE)
    fast_path: bool = True
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
    # The console links a call's W3C trace id here: ``{trace_id}`` in it is replaced (HERMES_TRACE_URL,
    # or config.yaml's ``console.trace_url``), e.g. http://localhost:16686/trace/{trace_id} for Jaeger.
    trace_url: str | None = None
    # A submission returns only once ``WAIT wait_replicas wait_timeout_ms`` confirms it (0: not asked).
    wait_replicas: int = 0
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS
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

    @functools.cached_property
    def max_args(self) -> int:
        """Bytes a call's arguments may take packed (``broker.max_args``, ``$HERMES_MAX_ARGS``; 32 MiB):
        a larger submission is ``invalid_args`` at once, never stored."""
        section = self.raw.get("broker")
        broker: dict[str, Any] = section if isinstance(section, dict) else {}
        value = _env_float(MAX_ARGS_ENV, _number(broker.get("max_args", DEFAULT_MAX_ARGS), "broker.max_args"))
        if value <= 0:
            raise ConfigError(f"broker.max_args / {MAX_ARGS_ENV}: expected a number of bytes > 0, got {value:g}")
        return int(value)

    def concurrency_for(self, kind: str) -> int:
        value = self.executor_settings(kind).get("concurrency", DEFAULT_CONCURRENCY)
        return int(_number(value, f"executors.{kind}.concurrency"))

    def queue_size_for(self, kind: str) -> int:
        value = self.executor_settings(kind).get("queue_size", DEFAULT_QUEUE_SIZE)
        return int(_number(value, f"executors.{kind}.queue_size"))


def _flag(value: Any, where: str) -> bool:
    """A yes/no setting (true/false, 1/0, yes/no, on/off), or a ConfigError naming it."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{where} (HERMES_REDIS_FAST_PATH): expected true or false, got {value!r}")


def _number(value: Any, where: str) -> float:
    """A number setting from config.yaml, or a ConfigError naming its path."""
    if isinstance(value, bool):
        raise ConfigError(f"config.yaml: {where}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.yaml: {where}: expected a number, got {value!r}") from e


def _mapping(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A section of config.yaml that must be a mapping (absent or empty: {})."""
    value = raw.get(key)
    if value is None or value == "":
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config.yaml: {key}: expected a mapping, got {type(value).__name__} {value!r}")
    return dict(value)


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
    broker = _mapping(raw, "broker")
    logging_cfg = _mapping(raw, "logging")
    workers = _mapping(raw, "workers")
    executors = _mapping(raw, "executors")
    for kind, section in executors.items():
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"config.yaml: executors.{kind}: expected a mapping, got {section!r}")
    _mapping(raw, "executor")  # the seed's singular spelling, merged under executors.<kind>
    level = str(os.environ.get("HERMES_LOG_LEVEL") or logging_cfg.get("level") or "INFO").upper()
    level = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(level, level)
    if level not in LOG_LEVELS:
        where = "HERMES_LOG_LEVEL" if os.environ.get("HERMES_LOG_LEVEL") else "config.yaml: logging.level"
        raise ConfigError(f"{where}: expected one of {', '.join(LOG_LEVELS)}, got {level!r}")
    wait_replicas = _env_float("HERMES_WAIT_REPLICAS", _number(broker.get("wait_replicas", 0), "broker.wait_replicas"))
    wait_timeout = _env_float(
        "HERMES_WAIT_TIMEOUT_MS",
        _number(broker.get("wait_timeout_ms", DEFAULT_WAIT_TIMEOUT_MS), "broker.wait_timeout_ms"),
    )
    if wait_replicas < 0 or wait_replicas != int(wait_replicas):
        raise ConfigError(f"broker.wait_replicas: expected a whole number of replicas >= 0, got {wait_replicas:g}")
    if wait_timeout <= 0 or wait_timeout != int(wait_timeout):
        raise ConfigError(f"broker.wait_timeout_ms: expected a whole number of milliseconds > 0, got {wait_timeout:g}")
    return Settings(
        home=root,
        redis_url=os.environ.get("HERMES_REDIS_URL") or broker.get("url") or None,
        fast_path=_flag(os.environ.get("HERMES_REDIS_FAST_PATH", broker.get("fast_path", True)), "broker.fast_path"),
        log_level=level,
        log_format=str(os.environ.get("HERMES_LOG_FORMAT") or logging_cfg.get("format") or "console"),
        lease=_env_float("HERMES_LEASE", _number(workers.get("lease", DEFAULT_LEASE), "workers.lease")),
        max_attempts=int(
            _env_float("HERMES_MAX_ATTEMPTS", _number(workers.get("max_attempts", 3), "workers.max_attempts"))
        ),
        result_ttl=int(
            _env_float("HERMES_RESULT_TTL", _number(workers.get("result_ttl", 86400), "workers.result_ttl"))
        ),
        executors=executors,
        policy=_mapping(raw, "policy"),
        plugins=_mapping(raw, "plugins"),
        model=_mapping(raw, "model"),
        mcp=_mapping(raw, "mcp"),
        audit=_mapping(raw, "audit"),
        trace_url=str(os.environ.get("HERMES_TRACE_URL") or _mapping(raw, "console").get("trace_url") or "") or None,
        wait_replicas=int(wait_replicas),
        wait_timeout_ms=int(wait_timeout),
        raw=raw,
    )
