"""The typed settings: one frozen section per part of config.yaml and its ``HERMES_*`` variables, filled
by :func:`broker.config.load_settings`; at the end, the speed shortcuts' switches."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, InvalidSpec
from .placeholders import load_yaml
from .ratelimits import RateLimit

DEFAULT_LEASE = 30.0
DEFAULT_RESULT_TTL = 3600  # how long an ended call's record and terminal event stay
DEFAULT_CONCURRENCY = 5
DEFAULT_QUEUE_SIZE = 10_000
DEFAULT_WAIT_TIMEOUT_MS = 500
DEFAULT_MAX_ARGS = 32 * 1024 * 1024  # bytes a call's arguments may take, packed (also the API's body limit)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TRACE_MODES = ("off", "console", "otlp", "zipkin", "memory")
# A worker keeps each call's objects alive for the call's duration: Python's default (700, 10, 10) scanned
# and promoted most of them before they died (docs/benchmarks.md).
GC_THRESHOLD = (50_000, 20, 10)
AGENT_PLUGIN = "hermes-gateway"  # the Hermes agent plugin's name in plugins.entries
API_KEYS = ("tokens", "token_principal")  # of config.yaml's api: (hermes_gateway/credentials.py)
DEFAULT_AUDIT_MAXLEN = 100_000
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
DEFAULT_BATCH_SHARE = 0.1


@dataclass(frozen=True)
class BrokerSettings:
    """``broker:`` — where the broker is and what a write waits for."""

    url: str | None = None  # broker.url / HERMES_REDIS_URL
    # redis-py's private insides for hot pipelines and pub/sub reads (broker/pipes.py): broker.fast_path /
    # HERMES_REDIS_FAST_PATH
    fast_path: bool = True
    # A submission returns only once ``WAIT wait_replicas wait_timeout_ms`` confirms it (0: not asked).
    wait_replicas: int = 0  # broker.wait_replicas / HERMES_WAIT_REPLICAS
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS  # broker.wait_timeout_ms / HERMES_WAIT_TIMEOUT_MS
    # Bytes a call's arguments may take packed: a larger submission is ``invalid_args`` at once, never stored.
    max_args: int = DEFAULT_MAX_ARGS  # broker.max_args / HERMES_MAX_ARGS


@dataclass(frozen=True)
class LoggingSettings:
    """``logging:`` — level and line format; a command's own workers log errors only unless asked."""

    level: str = "INFO"  # logging.level / HERMES_LOG_LEVEL
    format: str = "console"  # logging.format / HERMES_LOG_FORMAT
    level_set: bool = False  # a level was asked for (--log-level, HERMES_LOG_LEVEL, logging.level)
    worker_level: str | None = None  # HERMES_WORKER_LOG_LEVEL: the level of a command's own workers


@dataclass(frozen=True)
class WorkerSettings:
    """``workers:`` — leases and retries, and how a worker process runs."""

    lease: float = DEFAULT_LEASE  # workers.lease / HERMES_LEASE
    max_attempts: int = 3  # workers.max_attempts / HERMES_MAX_ATTEMPTS
    result_ttl: int = DEFAULT_RESULT_TTL  # workers.result_ttl / HERMES_RESULT_TTL
    # workers.keep_history / HERMES_KEEP_HISTORY: an ended call keeps every event, not its terminal one alone
    keep_history: bool = False
    gc_threshold: tuple[int, ...] | None = GC_THRESHOLD  # HERMES_GC_THRESHOLD ("default": None, Python's own)
    metrics_port: int | None = None  # HERMES_METRICS_PORT: Prometheus /metrics of a worker process
    metrics_host: str = "127.0.0.1"  # HERMES_METRICS_HOST
    run_registry: bool = False  # HERMES_RUN_REGISTRY: record this worker for `stop --all`
    shortcuts_off: frozenset[str] = frozenset()  # workers.shortcuts_off: speed shortcuts to run without


@dataclass(frozen=True)
class ApiSettings:
    """``serve``'s HTTP bounds (a bad or non-positive value keeps the default) and its admin token."""

    token: str | None = None  # HERMES_API_TOKEN (``--token`` wins)
    max_body: int = DEFAULT_MAX_ARGS  # HERMES_API_MAX_BODY: bytes of a request body
    body_timeout: float = 60.0  # HERMES_API_BODY_TIMEOUT: seconds to receive a whole body
    header_timeout: float = 10.0  # HERMES_API_HEADER_TIMEOUT: seconds from connect to a complete request head
    keep_alive: float = 5.0  # HERMES_API_KEEP_ALIVE: seconds an idle kept-alive connection stays open
    max_connections: int = 1000  # HERMES_API_MAX_CONNECTIONS
    # HERMES_API_ALLOWED_HOSTS: host names (beside loopback names and IP addresses) the routes that take no
    # token answer to when tokens are set (a name not listed could be a DNS rebinding page's)
    allowed_hosts: frozenset[str] = frozenset()


@dataclass(frozen=True)
class TelemetrySettings:
    """Tracing beyond the standard ``OTEL_*`` variables (which the OpenTelemetry SDK reads itself)."""

    trace: str = ""  # HERMES_TRACE: off, console, otlp or memory ("": the OTEL_* environment decides)
    lean_spans: bool = True  # HERMES_LEAN_SPANS=0: the SDK's own tracer


@dataclass(frozen=True)
class ConsoleSettings:
    """``console:`` — the web console."""

    # A call's W3C trace id is linked here: ``{trace_id}`` in it is replaced (console.trace_url /
    # HERMES_TRACE_URL), e.g. http://localhost:16686/trace/{trace_id} for Jaeger.
    trace_url: str | None = None


@dataclass(frozen=True)
class PluginDiscovery:
    """Hermes' own switches for finding plugins, and config.yaml's reader, for ``middleware``."""

    safe_mode: bool = False  # HERMES_SAFE_MODE: no plugin at all
    project_plugins: bool = False  # HERMES_ENABLE_PROJECT_PLUGINS: ./.hermes/plugins as well

    # config.yaml as the gateway reads it: the seed's unquoted ``{{field}}`` templates stay text.
    read_yaml = staticmethod(load_yaml)


@dataclass(frozen=True)
class AgentPluginSettings:
    """The Hermes agent plugin's options: ``HERMES_GATEWAY_*`` over ``plugins.entries.hermes-gateway``."""

    url: str | None = None  # HERMES_GATEWAY_URL / redis_url (else the broker's URL)
    route_llm: bool = False  # HERMES_GATEWAY_ROUTE_LLM / route_llm: the agent's LLM calls are queued too
    principal: str | None = None  # HERMES_GATEWAY_PRINCIPAL / principal
    timeout: float = 600.0  # HERMES_GATEWAY_TIMEOUT / timeout
    tool_prefix: str = ""  # HERMES_GATEWAY_TOOL_PREFIX / tool_prefix


@dataclass(frozen=True)
class AuditSettings:
    """``audit:`` — the audit log's retention and JSONL mirror (``broker.audit.AuditLog``)."""

    key: str | None = None  # audit.key: the stream (None: hermes:{audit}); tests use their own
    maxlen: int = DEFAULT_AUDIT_MAXLEN  # audit.maxlen: records kept (0: no count limit)
    max_age: float = 0.0  # audit.max_age: seconds a record is kept (0: no age limit)
    approximate: bool = True  # audit.approximate: trim with ``~`` (cheaper, may keep a few more)
    jsonl: str | None = None  # audit.jsonl: a file every record is also appended to


@dataclass(frozen=True)
class ModelSettings:
    """``model:`` — the LLM provider the ``llm`` workers call (Hermes' own keys of it are not read here)."""

    provider: str = ""  # model.provider: openai-compatible (""), openai, deepseek, ollama, vllm, ...
    model: str = ""  # model.model: used when neither the request nor the call's context names one
    base_url: str = ""  # model.base_url ("": the named provider's default address)
    api_key: str = field(default="", repr=False)  # model.api_key (``${VAR}`` keeps it out of the file)
    api_key_unset: str = ""  # the variable model.api_key names when it is not set (its key then reads empty)
    api_mode: str = ""  # model.api_mode ("": chat_completions)
    timeout: float = 120.0  # model.timeout: seconds a call may take (its own timeout wins)
    max_retries: int = 2  # model.max_retries: retries of a failed attempt (429, 5xx, connection)
    max_retry_after: float = 60.0  # model.max_retry_after: longest Retry-After honoured, seconds
    headers: dict[str, str] = field(default_factory=dict)  # model.headers: sent with every request
    # model.rate_limits: "<provider>/<model>" or "<model>" -> the fleet-wide limit of its calls (provider: this
    # section's, the one the workers call, whatever a call's context names)
    rate_limits: dict[str, RateLimit] = field(default_factory=dict)

    def rate_limit_for(self, provider: str, model: str) -> RateLimit | None:
        """The rate limit of ``model`` on ``provider``: ``provider/model`` first, then the model alone."""
        return self.rate_limits.get(f"{provider}/{model}") or self.rate_limits.get(model)


@dataclass(frozen=True)
class FairnessSettings:
    """``fairness:`` — the order in which calls waiting for a slot of a concurrency key get one."""

    # fairness.weights: principal (or fairness key) -> weight (default 1), its share of slots while all wait
    weights: dict[str, float] = field(default_factory=dict)
    # The least share of promotions batch calls get while interactive calls wait too.
    batch_share: float = DEFAULT_BATCH_SHARE  # fairness.batch_share / HERMES_BATCH_SHARE
    # Calls one fairness key (in one class) may have waiting (None: only queue_size bounds them).
    queue_size_per_key: int | None = None  # fairness.queue_size_per_key / HERMES_QUEUE_SIZE_PER_KEY

    def weight_of(self, principal: str | None, fairness_key: str) -> float:
        """The weight of a call: its principal's, else its fairness key's, else 1."""
        if principal is not None and principal in self.weights:
            return self.weights[principal]
        return self.weights.get(fairness_key, 1.0)


@dataclass(frozen=True)
class McpSettings:
    """``mcp:`` — the seed's spelling of ``executors.mcp.handshake_timeout`` (which wins over it)."""

    handshake_timeout: float | None = None  # mcp.handshake_timeout (None: the executor's 10 s)


@dataclass(frozen=True)
class BatchSettings:
    """``batch:`` — batches as objects (``hermes_gateway/batches.py``)."""

    ttl: int = 86400  # batch.ttl / HERMES_BATCH_TTL: seconds a batch's meta, counters and results are kept
    window: int = 1000  # batch.window / HERMES_BATCH_WINDOW: calls a submitter keeps unfinished at most


@dataclass(frozen=True)
class Settings:
    """Every setting the gateway reads. Environment variables override the file."""

    home: Path
    broker: BrokerSettings = BrokerSettings()
    logging: LoggingSettings = LoggingSettings()
    workers: WorkerSettings = WorkerSettings()
    api: ApiSettings = ApiSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    console: ConsoleSettings = ConsoleSettings()
    plugin_discovery: PluginDiscovery = PluginDiscovery()
    agent_plugin: AgentPluginSettings = AgentPluginSettings()
    audit: AuditSettings = AuditSettings()
    model: ModelSettings = ModelSettings()
    mcp: McpSettings = McpSettings()
    fairness: FairnessSettings = FairnessSettings()
    batch: BatchSettings = BatchSettings()
    # Per kind, each executor checks its own keys (executor_settings merges them; see there).
    executors: dict[str, Any] = field(default_factory=dict)
    # Parsed into the typed workers.policy.Policy, which broker cannot import (workers depends on broker).
    policy: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # expanded: may hold secrets
    # (dotted key, variable) of config.yaml's ${VAR}s that are not set here: they read as empty
    unset_vars: tuple[tuple[str, str], ...] = ()
    unknown_keys: tuple[str, ...] = ()  # keys of config.yaml read by nothing (a typo): said at start

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
        if kind == "mcp" and self.mcp.handshake_timeout is not None:
            base["handshake_timeout"] = self.mcp.handshake_timeout  # the seed's spelling, at the top level
        base.update(self.executors.get(kind) or {})
        return base

    def concurrency_for(self, kind: str) -> int:
        value = self.executor_settings(kind).get("concurrency", DEFAULT_CONCURRENCY)
        return int(yaml_number(value, f"executors.{kind}.concurrency"))

    def queue_size_for(self, kind: str) -> int:
        value = self.executor_settings(kind).get("queue_size", DEFAULT_QUEUE_SIZE)
        return int(yaml_number(value, f"executors.{kind}.queue_size"))


def yaml_number(value: Any, where: str) -> float:
    """A number setting from config.yaml, or a ConfigError naming its path."""
    if isinstance(value, bool):
        raise ConfigError(f"config.yaml: {where}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.yaml: {where}: expected a number, got {value!r}") from e


def audit_settings(section: Mapping[str, Any] | None) -> AuditSettings:
    """``audit: {maxlen, max_age (seconds), approximate, jsonl, key}``; a typo or a bad number is an error."""
    audit = dict(section or {})
    unknown = set(audit) - {"maxlen", "max_age", "approximate", "jsonl", "key"}
    if unknown:
        raise ConfigError(f"audit: unknown key(s) {sorted(unknown)}")
    try:
        maxlen = int(audit.get("maxlen", DEFAULT_AUDIT_MAXLEN) or 0)
        max_age = float(audit.get("max_age") or 0)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"audit: maxlen and max_age must be numbers: {e}") from e
    if maxlen < 0 or max_age < 0:
        raise ConfigError("audit: maxlen and max_age must not be negative")
    return AuditSettings(
        key=str(audit["key"]) if audit.get("key") else None, maxlen=maxlen, max_age=max_age,
        approximate=flag(audit.get("approximate", True), "audit.approximate"),
        jsonl=str(audit["jsonl"]) if audit.get("jsonl") else None,
    )


def model_settings(section: dict[str, Any], api_key_unset: str = "") -> ModelSettings:
    """``model:`` — the keys the LLM workers read; Hermes' own (``default``, ...) are left to it."""
    headers = section.get("headers") or {}
    if not isinstance(headers, dict):
        raise ConfigError(f"config.yaml: model.headers: expected a mapping, got {headers!r}")
    retries = yaml_number(section.get("max_retries", 2), "model.max_retries")
    if retries != int(retries):
        raise ConfigError(f"config.yaml: model.max_retries: expected a whole number, got {retries:g}")
    return ModelSettings(
        provider=str(section.get("provider") or ""), model=str(section.get("model") or ""),
        base_url=str(section.get("base_url") or ""), api_key=str(section.get("api_key") or ""),
        api_key_unset=api_key_unset,
        api_mode=str(section.get("api_mode") or ""),
        timeout=yaml_number(section.get("timeout") or ModelSettings.timeout, "model.timeout"),
        max_retries=max(0, int(retries)),
        max_retry_after=yaml_number(
            section.get("max_retry_after", ModelSettings.max_retry_after), "model.max_retry_after"
        ),
        headers={str(k): str(v) for k, v in headers.items()},
        rate_limits=rate_limits(section.get("rate_limits")),
    )


def rate_limits(section: Any) -> dict[str, RateLimit]:
    """``model.rate_limits: {"<provider>/<model>" | "<model>": {requests_per_minute, tokens_per_minute,
    requests_per_second}}``; a bad entry is a ConfigError naming it."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"config.yaml: model.rate_limits: expected a mapping of model -> limits, got {section!r}")
    out: dict[str, RateLimit] = {}
    for key, value in section.items():
        try:
            limit = RateLimit.parse(f"config.yaml: model.rate_limits.{key}", value)
        except InvalidSpec as e:
            raise ConfigError(e.message.replace(": rate_limit.", ".", 1).replace(": rate_limit:", ":", 1)) from e
        if limit is not None:
            out[str(key)] = limit
    return out


def fairness_settings(
    section: Mapping[str, Any], batch_share: str | None = None, per_key: str | None = None
) -> FairnessSettings:
    """``fairness: {weights, batch_share, queue_size_per_key}``; ``batch_share`` / ``per_key``: the
    environment's values, which win. A typo, a weight that is not positive, a share outside 0..1 is an error."""
    unknown = set(section) - {"weights", "batch_share", "queue_size_per_key"}
    if unknown:
        raise ConfigError(f"config.yaml: fairness: unknown key(s) {sorted(unknown)}")
    weights = section.get("weights") or {}
    if not isinstance(weights, dict):
        raise ConfigError(f"config.yaml: fairness.weights: expected a mapping of principal to weight, got {weights!r}")
    parsed: dict[str, float] = {}
    for who, w in weights.items():
        value = yaml_number(w, f"fairness.weights.{who}")
        if not 0.001 <= value <= 1000:
            raise ConfigError(f"config.yaml: fairness.weights.{who}: expected a weight from 0.001 to 1000, got {w!r}")
        parsed[str(who)] = value
    share = _setting(batch_share, "HERMES_BATCH_SHARE", section.get("batch_share"), "fairness.batch_share")
    if share is not None and not 0 <= share <= 1:
        raise ConfigError(f"fairness.batch_share (HERMES_BATCH_SHARE): expected a share from 0 to 1, got {share:g}")
    size = _setting(per_key, "HERMES_QUEUE_SIZE_PER_KEY", section.get("queue_size_per_key"), "fairness.queue_size_per_key")
    if size is not None and (size != int(size) or size < 0):
        raise ConfigError(
            f"fairness.queue_size_per_key (HERMES_QUEUE_SIZE_PER_KEY): expected a whole number of calls, got {size:g}"
        )
    return FairnessSettings(
        weights=parsed, batch_share=DEFAULT_BATCH_SHARE if share is None else share,
        queue_size_per_key=None if size is None else int(size),
    )


def _setting(from_env: str | None, env_name: str, from_file: Any, where: str) -> float | None:
    """A number from the environment (which wins) or config.yaml; None when neither sets it."""
    if from_env not in (None, ""):
        try:
            return float(from_env)  # type: ignore[arg-type]
        except ValueError as e:
            raise ConfigError(f"{env_name}: expected a number, got {from_env!r}") from e
    return None if from_file is None else yaml_number(from_file, where)


# Hermes' own keys under mcp: (``hermes config set mcp.auto_reload_on_config_change false``): a config.yaml the
# agent shares (its plugin reads it too) may hold them; they are Hermes' to read.
MCP_KEYS_OF_HERMES = frozenset({"auto_reload_on_config_change"})


def mcp_settings(section: dict[str, Any]) -> McpSettings:
    """``mcp: {handshake_timeout}`` (the seed's spelling); other MCP settings go under ``executors.mcp``."""
    unknown = set(section) - {"handshake_timeout", *MCP_KEYS_OF_HERMES}
    if unknown:
        raise ConfigError(
            f"config.yaml: mcp: unknown key(s) {sorted(unknown)} (only handshake_timeout; "
            "the mcp executor's other settings go under executors.mcp)"
        )
    timeout = section.get("handshake_timeout")
    return McpSettings(None if timeout is None else yaml_number(timeout, "mcp.handshake_timeout"))


def flag(value: Any, where: str, env_name: str | None = None) -> bool:
    """A yes/no setting (true/false, 1/0, yes/no, on/off), or a ConfigError naming it."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    named = f"{where} ({env_name})" if env_name else f"config.yaml: {where}"
    raise ConfigError(f"{named}: expected true or false, got {value!r}")


# -- the speed shortcuts' switches ------------------------------------------------------------------
# Speed shortcuts with a stock twin, so each can be measured on and off (``bench/shortcuts.py``) and turned
# off where it misbehaves (``workers.shortcuts_off``): ``threads`` (workers/worker.py), ``quickcheck``
# (workers/args.py), ``frozen`` (broker/envelope.filler), ``redaction`` (broker/logs.redact_event). A
# worker process sets them once (``configure_shortcuts``); each shortcut asks ``shortcut_on(name)``.

SHORTCUTS = ("threads", "quickcheck", "frozen", "redaction")

_shortcuts_off: frozenset[str] = frozenset()


def check_shortcuts(names: Iterable[str], where: str = "workers.shortcuts_off") -> frozenset[str]:
    """The names as a set; ConfigError naming any that is not a shortcut."""
    found = frozenset(str(n).strip() for n in names if str(n).strip())
    unknown = sorted(found - set(SHORTCUTS))
    if unknown:
        raise ConfigError(f"{where}: unknown shortcut(s) {', '.join(unknown)}; known: {', '.join(SHORTCUTS)}")
    return found


def configure_shortcuts(off: Iterable[str]) -> None:
    """Turn off the shortcuts named (and every other one on)."""
    global _shortcuts_off
    _shortcuts_off = check_shortcuts(off)


def shortcut_on(name: str) -> bool:
    """Whether the shortcut ``name`` is in use in this process."""
    return name not in _shortcuts_off
