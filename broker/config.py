"""One typed settings object, read from ``$HERMES_HOME/config.yaml`` and the environment when asked.

Every ``HERMES_*`` variable is read here and nowhere else (tests/broker/test_config.py checks it). An
environment variable wins over the file; a bad value is a ``ConfigError`` naming where it came from.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, InvalidSpec
from .placeholders import load_yaml
from .settings import (
    AGENT_PLUGIN,
    API_KEYS,
    DEFAULT_CONCURRENCY,
    DEFAULT_LEASE,
    DEFAULT_MAX_ARGS,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_RESULT_TTL,
    DEFAULT_WAIT_TIMEOUT_MS,
    GC_THRESHOLD,
    LOG_LEVELS,
    TRACE_MODES,
    AgentPluginSettings,
    ApiSettings,
    AuditSettings,
    BatchSettings,
    BrokerSettings,
    ConsoleSettings,
    FairnessSettings,
    LoggingSettings,
    McpSettings,
    ModelSettings,
    PluginDiscovery,
    Settings,
    TelemetrySettings,
    WorkerSettings,
    audit_settings,
    check_shortcuts,
    fairness_settings,
    flag,
    mcp_settings,
    model_settings,
    yaml_number,
)

# What config readers import from here: the loader and, re-exported, the settings it builds.
__all__ = [
    "DEFAULT_CONCURRENCY", "DEFAULT_MAX_ARGS", "DEFAULT_QUEUE_SIZE", "GC_THRESHOLD", "LOG_LEVELS",
    "TRACE_MODES", "AgentPluginSettings", "ApiSettings", "AuditSettings", "BatchSettings", "BrokerSettings",
    "ConsoleSettings", "FairnessSettings", "LoggingSettings", "McpSettings", "ModelSettings",
    "PluginDiscovery", "Settings", "TelemetrySettings", "WorkerSettings", "expand_env", "hermes_home",
    "load_settings", "unset_env",
]

# The ``${VAR}`` / ``${VAR:-default}`` grammar of :func:`expand_env`.
ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")

REDIS_URL_ENV = "HERMES_REDIS_URL"
FAST_PATH_ENV = "HERMES_REDIS_FAST_PATH"
KEEP_HISTORY_ENV = "HERMES_KEEP_HISTORY"
MAX_ARGS_ENV = "HERMES_MAX_ARGS"
TRACE_ENV = "HERMES_TRACE"
GC_ENV = "HERMES_GC_THRESHOLD"
METRICS_PORT_ENV = "HERMES_METRICS_PORT"  # /metrics of a worker process (`worker --metrics-port`)
METRICS_HOST_ENV = "HERMES_METRICS_HOST"
RUN_REGISTRY_ENV = "HERMES_RUN_REGISTRY"  # set by `worker`/`serve`: their worker processes record themselves
API_MAX_BODY_ENV = "HERMES_API_MAX_BODY"
API_BODY_TIMEOUT_ENV = "HERMES_API_BODY_TIMEOUT"


def hermes_home(
    explicit: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> Path:
    """``$HERMES_HOME`` or ``~/.hermes``."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ if environ is None else environ
    return Path(env.get("HERMES_HOME") or "~/.hermes").expanduser()


def expand_env(value: Any, environ: Mapping[str, str] | None = None) -> Any:
    """Replace ``${VAR}`` (and ``${VAR:-default}``) in every string, so secrets stay out of files."""
    env = os.environ if environ is None else environ
    if isinstance(value, str):
        return ENV_VAR.sub(lambda m: env.get(m.group(1), m.group(2) if m.group(2) is not None else ""), value)
    if isinstance(value, dict):
        return {k: expand_env(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, env) for v in value]
    return value


def unset_env(text: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Names of the ``${VAR}`` references in ``text`` that :func:`expand_env` would have to leave empty:
    the variable is not set and the reference gives no ``:-default``."""
    env = os.environ if environ is None else environ
    return [m.group(1) for m in ENV_VAR.finditer(text) if m.group(2) is None and m.group(1) not in env]


def _limits(section: Mapping[str, Any], where: str) -> None:
    """An executor section's ``concurrency`` (at least 1: a limit of 0 would leave every call waiting) and
    ``queue_size`` (at least 0), when set, or a ConfigError naming the key."""
    for key, low in (("concurrency", 1), ("queue_size", 0)):
        value = section.get(key)
        try:  # (a ${VAR} expands to text: "5" counts as 5)
            number = None if value is None or isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            number = None
        if value is not None and (number is None or number != int(number) or number < low):
            raise ConfigError(f"config.yaml: {where}.{key}: expected an integer of at least {low}, got {value!r}")
    if section.get("breaker") is None:
        return
    from .specchecks import check_options  # (jsonschema's: a client that reads its settings never needs it)

    try:  # (the breaker every tool of the kind gets: a bad value failed each of their calls, internal_error)
        check_options(f"config.yaml: {where}", "breaker", section.get("breaker"))
    except InvalidSpec as e:
        raise ConfigError(str(e)) from None


OVERRIDE_PREFIX = "HERMES__"


def _overridden(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``raw`` with every ``HERMES__<SECTION>__<KEY>[__<KEY>...]=value`` applied: any config.yaml setting
    from the environment (executors.http.concurrency as ``HERMES__`` + ``EXECUTORS__HTTP__CONCURRENCY``),
    the value read as YAML (``10``, ``true``, ``[a, b]``); the named ``HERMES_*`` variables still win."""
    for name in sorted(n for n in env if n.startswith(OVERRIDE_PREFIX)):
        path = [part.lower() for part in name[len(OVERRIDE_PREFIX) :].split("__")]
        if not all(path):
            raise ConfigError(f"{name}: expected HERMES__<SECTION>__<KEY>, with no empty part")
        try:
            value = yaml.safe_load(env[name])
        except yaml.YAMLError:
            value = env[name]
        node = raw
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return raw


def load_settings(
    home: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Read ``config.yaml`` (if any), expand ``${VAR}``, apply ``HERMES_*`` overrides (from ``environ``,
    default this process's environment)."""
    env = os.environ if environ is None else environ
    root = hermes_home(home, env)
    written = _read_config(root / "config.yaml")
    raw = _overridden(expand_env(written, env), env)
    # ${VAR}s that read as empty, as docker compose reads them; a worker says so when it starts, and an LLM
    # call refused for its key says which variable it came from.
    unset = tuple(unset_refs(written, raw, env))
    executors = _mapping(raw, "executors")
    limited = {"executor": _mapping(raw, "executor")}  # the seed's singular spelling, merged under executors.<kind>
    for kind, section in executors.items():
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"config.yaml: executors.{kind}: expected a mapping, got {section!r}")
        limited[f"executors.{kind}"] = section or {}
    for where, section in limited.items():
        _limits(section, where)
    logging_ = _logging(_mapping(raw, "logging"), env)
    broker = _broker(_mapping(raw, "broker"), env)
    plugins = _mapping(raw, "plugins")
    return Settings(
        home=root,
        broker=broker,
        logging=logging_,
        workers=_workers(_mapping(raw, "workers"), env),
        api=_api(env),
        telemetry=_telemetry(env),
        console=ConsoleSettings(
            trace_url=str(env.get("HERMES_TRACE_URL") or _mapping(raw, "console").get("trace_url") or "")
            or None
        ),
        plugin_discovery=PluginDiscovery(
            safe_mode=_truthy(env.get("HERMES_SAFE_MODE", "")),
            project_plugins=_truthy(env.get("HERMES_ENABLE_PROJECT_PLUGINS", "")),
        ),
        agent_plugin=_agent_plugin(plugins, env, broker.url),
        audit=audit_settings(_mapping(raw, "audit")),
        model=model_settings(
            # (``model: NAME``, Hermes' spelling of the model's name alone, as in the agent's config.yaml)
            {"model": raw["model"]} if isinstance(raw.get("model"), str) else _mapping(raw, "model"),
            next((n for k, n in unset if k == "model.api_key"), ""),
        ),
        mcp=mcp_settings(_mapping(raw, "mcp")),
        fairness=fairness_settings(
            _mapping(raw, "fairness"), env.get("HERMES_BATCH_SHARE"), env.get("HERMES_QUEUE_SIZE_PER_KEY")
        ),
        batch=_batch(_mapping(raw, "batch"), env),
        executors=executors,
        policy=_mapping(raw, "policy"),
        raw=raw,
        unset_vars=unset,
        unknown_keys=(
            *(typo for where, known in KNOWN_KEYS.items() for typo in _unknown(where, _at(raw, where), known)),
            # (an executor's section holds any setting of its kind: only a near miss of a limit is named there)
            *(typo for where, section in limited.items()
              for typo in _unknown(where, section, ("concurrency", "queue_size"), near_only=True)),
        ),
    )


def _read_config(path: Path) -> dict[str, Any]:
    """config.yaml as written (its ``${VAR}``s not expanded yet); {} when there is none."""
    if not path.exists():
        return {}
    try:
        loaded = load_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return loaded


def unset_refs(written: Any, now: Any, environ: Mapping[str, str], where: str = "") -> list[tuple[str, str]]:
    """(dotted key, variable) of every ``${VAR}`` in ``written``'s strings that is not set and has no
    ``:-default``, where the setting still reads empty in ``now`` (the settings as overridden: a HERMES_*
    variable may have set what the file left to an unset ${VAR})."""
    if isinstance(written, str):
        return [(where, name) for name in unset_env(written, environ)] if now in (None, "") else []
    if isinstance(written, dict):
        keyed = now if isinstance(now, dict) else {}
        return [ref for k, v in written.items()
                for ref in unset_refs(v, keyed.get(k), environ, f"{where}.{k}" if where else str(k))]
    if isinstance(written, list):
        items = now if isinstance(now, list) else []
        return [ref for i, v in enumerate(written)
                for ref in unset_refs(v, items[i] if i < len(items) else None, environ, f"{where}[{i}]")]
    return []


# The sections of config.yaml that are ours alone and the keys read of each; any other key of one is named when a
# command or a worker starts (a typo reads as nothing set). Sections not listed are Hermes' (the file is shared),
# model: (shared with it) or checked where they are read: audit, mcp, fairness (an error), executors, policy.
KNOWN_KEYS: dict[str, tuple[str, ...]] = {
    "logging": ("level", "format"),
    "broker": ("url", "fast_path", "wait_replicas", "wait_timeout_ms", "max_args"),
    "workers": ("lease", "max_attempts", "result_ttl", "keep_history", "shortcuts_off"),
    "batch": ("ttl", "window"),
    "console": ("trace_url",),
    "api": API_KEYS,
    "telemetry": (),  # (HERMES_TRACE and HERMES_LEAN_SPANS alone)
    f"plugins.entries.{AGENT_PLUGIN}": ("redis_url", "route_llm", "principal", "timeout", "tool_prefix"),
}


def _at(raw: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """The mapping at dotted ``path`` of ``raw`` ({} when there is none)."""
    node: Any = raw
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def _unknown(
    where: str, section: Mapping[str, Any], known: tuple[str, ...], near_only: bool = False
) -> tuple[str, ...]:
    """What a command and a worker warn of: the keys of ``section`` it does not read (a typo reads as
    nothing set), each with the nearest known key (``near_only``: only the keys near one)."""
    import difflib

    out = []
    for key in section:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            if near_only and not near:
                continue
            listed = ", ".join(known) or "none, HERMES_* variables set it"
            hint = f" (did you mean {where}.{near[0]}?)" if near else f" (known: {listed})"
            out.append(f"config.yaml: {where}.{key} is not a setting{hint}")
    return tuple(out)


def _logging(section: dict[str, Any], env: Mapping[str, str]) -> LoggingSettings:
    level = _level(env.get("HERMES_LOG_LEVEL"), section.get("level"), "HERMES_LOG_LEVEL", "logging.level")
    fmt = str(env.get("HERMES_LOG_FORMAT") or section.get("format") or "console").strip().lower()
    if fmt not in ("console", "json"):
        raise ConfigError(f"logging.format (HERMES_LOG_FORMAT): expected console or json, got {fmt!r}")
    return LoggingSettings(
        level=level or "INFO",
        format=fmt,
        level_set=level is not None,
        worker_level=_level(env.get("HERMES_WORKER_LOG_LEVEL"), None, "HERMES_WORKER_LOG_LEVEL", ""),
    )


def _level(from_env: str | None, from_file: Any, env_name: str, key: str) -> str | None:
    """A log level (WARN and FATAL as Python spells them), or None when neither says one."""
    asked = from_env or from_file
    if not asked:
        return None
    level = str(asked).upper()
    level = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(level, level)
    if level not in LOG_LEVELS:
        where = env_name if from_env else f"config.yaml: {key}"
        raise ConfigError(f"{where}: expected one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return level


def _broker(section: dict[str, Any], env: Mapping[str, str]) -> BrokerSettings:
    replicas = _number(env, "HERMES_WAIT_REPLICAS", section, "broker.wait_replicas", 0)
    timeout = _number(
        env, "HERMES_WAIT_TIMEOUT_MS", section, "broker.wait_timeout_ms", DEFAULT_WAIT_TIMEOUT_MS
    )
    wait_replicas = _whole(replicas, 0, "broker.wait_replicas", "a whole number of replicas >= 0")
    wait_timeout = _whole(timeout, 1, "broker.wait_timeout_ms", "a whole number of milliseconds > 0")
    max_args = _number(env, MAX_ARGS_ENV, section, "broker.max_args", DEFAULT_MAX_ARGS)
    if max_args <= 0:
        raise ConfigError(
            f"broker.max_args / {MAX_ARGS_ENV}: expected a number of bytes > 0, got {max_args:g}"
        )
    fast_path = env.get(FAST_PATH_ENV, section.get("fast_path", True))
    return BrokerSettings(
        url=env.get(REDIS_URL_ENV) or section.get("url") or None,
        fast_path=flag(fast_path, "broker.fast_path", FAST_PATH_ENV),
        wait_replicas=wait_replicas,
        wait_timeout_ms=wait_timeout,
        max_args=int(max_args),
    )


def _workers(section: dict[str, Any], env: Mapping[str, str]) -> WorkerSettings:
    lease = _number(env, "HERMES_LEASE", section, "workers.lease", DEFAULT_LEASE)
    attempts = _number(env, "HERMES_MAX_ATTEMPTS", section, "workers.max_attempts", 3)
    ttl = _number(env, "HERMES_RESULT_TTL", section, "workers.result_ttl", DEFAULT_RESULT_TTL)
    if lease <= 0:
        raise ConfigError(f"workers.lease (HERMES_LEASE): expected seconds above 0, got {lease:g}")
    max_attempts = _whole(attempts, 1, "workers.max_attempts (HERMES_MAX_ATTEMPTS)", "a whole number of at least 1")
    result_ttl = _whole(ttl, 1, "workers.result_ttl (HERMES_RESULT_TTL)", "whole seconds of at least 1")
    port = env.get(METRICS_PORT_ENV, "").strip()
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"{METRICS_PORT_ENV}: expected a port number, got {port!r}")
    return WorkerSettings(
        lease=lease,
        max_attempts=max_attempts,
        result_ttl=result_ttl,
        gc_threshold=_gc_threshold(env.get(GC_ENV, "")),
        metrics_port=int(port) if port else None,
        metrics_host=env.get(METRICS_HOST_ENV) or "127.0.0.1",
        run_registry=bool(env.get(RUN_REGISTRY_ENV)),
        keep_history=flag(
            env.get(KEEP_HISTORY_ENV, section.get("keep_history", False)), "workers.keep_history", KEEP_HISTORY_ENV
        ),
        shortcuts_off=_shortcuts_off(section.get("shortcuts_off") or ()),
    )


def _shortcuts_off(raw: Any) -> frozenset[str]:
    names = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(names, list | tuple):
        raise ConfigError(f"workers.shortcuts_off: expected a list of names, got {raw!r}")
    return check_shortcuts(names)


def _batch(section: dict[str, Any], env: Mapping[str, str]) -> BatchSettings:
    ttl = _number(env, "HERMES_BATCH_TTL", section, "batch.ttl", BatchSettings.ttl)
    window = _number(env, "HERMES_BATCH_WINDOW", section, "batch.window", BatchSettings.window)
    return BatchSettings(
        ttl=_whole(ttl, 1, "batch.ttl / HERMES_BATCH_TTL", "whole seconds >= 1"),
        window=_whole(window, 1, "batch.window / HERMES_BATCH_WINDOW", "a whole number >= 1"),
    )


def _gc_threshold(raw: str) -> tuple[int, ...] | None:
    """The thresholds ``HERMES_GC_THRESHOLD`` asks for ("N[,N[,N]]"; "default": Python's own, None),
    else ``GC_THRESHOLD``; a malformed value is a ConfigError naming the variable."""
    raw = raw.strip()
    if raw.lower() == "default":
        return None
    if not raw:
        return GC_THRESHOLD
    try:
        wanted = tuple(int(part) for part in raw.split(","))
    except ValueError:
        wanted = ()
    # A first value of 0 would switch automatic collection off: cycles would never be freed.
    if not 1 <= len(wanted) <= 3 or wanted[0] < 1 or any(n < 0 for n in wanted):
        raise ConfigError(
            f"{GC_ENV} must be one to three integers like '50000,20,10' (the first at least 1), "
            f"or 'default' for Python's own; got {raw!r}"
        )
    return wanted


def _api(env: Mapping[str, str]) -> ApiSettings:
    return ApiSettings(
        token=env.get("HERMES_API_TOKEN") or None,
        max_body=int(_lenient(env, API_MAX_BODY_ENV, ApiSettings.max_body, whole=True)),
        body_timeout=_lenient(env, API_BODY_TIMEOUT_ENV, ApiSettings.body_timeout),
        header_timeout=_lenient(env, "HERMES_API_HEADER_TIMEOUT", ApiSettings.header_timeout),
        keep_alive=_lenient(env, "HERMES_API_KEEP_ALIVE", ApiSettings.keep_alive),
        max_connections=int(_lenient(env, "HERMES_API_MAX_CONNECTIONS", ApiSettings.max_connections)),
        allowed_hosts=frozenset(
            name.strip().lower() for name in env.get("HERMES_API_ALLOWED_HOSTS", "").split(",") if name.strip()
        ),
    )


def _lenient(env: Mapping[str, str], name: str, default: float, whole: bool = False) -> float:
    """A positive number from the environment, else ``default`` (a bad value is ignored, not fatal)."""
    raw = env.get(name, "")
    try:
        value = (int(raw) if whole else float(raw)) if raw else default
    except ValueError:
        return default
    return value if value > 0 else default


def _telemetry(env: Mapping[str, str]) -> TelemetrySettings:
    mode = env.get(TRACE_ENV, "").strip().lower()
    if mode in ("none", "0", "false", "no"):
        mode = "off"
    if mode and mode not in TRACE_MODES:
        raise ConfigError(f"{TRACE_ENV}: expected one of {', '.join(TRACE_MODES)}, got {mode!r}")
    return TelemetrySettings(trace=mode, lean_spans=flag(env.get("HERMES_LEAN_SPANS", "1"), "lean spans", "HERMES_LEAN_SPANS"))


def _agent_plugin(
    plugins: dict[str, Any], env: Mapping[str, str], broker_url: str | None
) -> AgentPluginSettings:
    entries = plugins.get("entries")
    entry = entries.get(AGENT_PLUGIN) if isinstance(entries, dict) else None
    entry = entry if isinstance(entry, dict) else {}
    timeout = env.get("HERMES_GATEWAY_TIMEOUT") or entry.get("timeout") or 600.0
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        seconds = math.nan
    if not 0 < seconds < math.inf:  # (0 or less failed every call at once; nan never timed out)
        where = f"HERMES_GATEWAY_TIMEOUT / plugins.entries.{AGENT_PLUGIN}.timeout"
        raise ConfigError(f"{where}: expected a number of seconds more than 0, got {timeout!r}")
    return AgentPluginSettings(
        url=env.get("HERMES_GATEWAY_URL") or entry.get("redis_url") or broker_url,
        route_llm=_truthy(env.get("HERMES_GATEWAY_ROUTE_LLM", entry.get("route_llm", False))),
        principal=env.get("HERMES_GATEWAY_PRINCIPAL") or entry.get("principal") or None,
        timeout=seconds,
        tool_prefix=str(env.get("HERMES_GATEWAY_TOOL_PREFIX") or entry.get("tool_prefix") or ""),
    )


def _truthy(value: Any) -> bool:
    """An opt-in switch, read as Hermes reads them (1/true/yes/on; anything else is off)."""
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _number(
    env: Mapping[str, str], name: str, section: Mapping[str, Any], where: str, default: float
) -> float:
    """A number from env var ``name``, else config.yaml's ``where`` (``section.key``), else ``default``."""
    from_file = yaml_number(section.get(where.rpartition(".")[2], default), where)
    raw = env.get(name)
    if not raw:
        return from_file
    try:
        return float(raw)
    except ValueError as e:
        raise ConfigError(f"{name}: expected a number, got {raw!r}") from e


def _whole(value: float, least: int, where: str, expected: str) -> int:
    """``value`` as an int; a ConfigError when it is not a whole number >= ``least``."""
    if value < least or value != int(value):
        raise ConfigError(f"{where}: expected {expected}, got {value:g}")
    return int(value)


def _mapping(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A section of config.yaml that must be a mapping (absent or empty: {})."""
    value = raw.get(key)
    if value is None or value == "":
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config.yaml: {key}: expected a mapping, got {type(value).__name__} {value!r}")
    return dict(value)
