"""Settings: one typed object, and every ``HERMES_*`` variable read in ``broker/config.py`` and nowhere else."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.config import Settings, load_settings
from broker.errors import ConfigError
from middleware import PLAIN, PluginManager, enable_plugin
from tests.conftest import REPO
from tests.middleware.helpers import write_plugin

# Every variable but HERMES_HOME: (name, a value, the Settings attribute it sets, what that attribute becomes).
VARIABLES: list[tuple[str, str, str, Any]] = [
    ("HERMES_REDIS_URL", "redis://h:1/2", "broker.url", "redis://h:1/2"),
    ("HERMES_REDIS_FAST_PATH", "off", "broker.fast_path", False),
    ("HERMES_WAIT_REPLICAS", "2", "broker.wait_replicas", 2),
    ("HERMES_WAIT_TIMEOUT_MS", "250", "broker.wait_timeout_ms", 250),
    ("HERMES_MAX_ARGS", "1000", "broker.max_args", 1000),
    ("HERMES_LOG_LEVEL", "warn", "logging.level", "WARNING"),
    ("HERMES_LOG_FORMAT", "json", "logging.format", "json"),
    ("HERMES_WORKER_LOG_LEVEL", "debug", "logging.worker_level", "DEBUG"),
    ("HERMES_LEASE", "5", "workers.lease", 5.0),
    ("HERMES_MAX_ATTEMPTS", "7", "workers.max_attempts", 7),
    ("HERMES_RESULT_TTL", "60", "workers.result_ttl", 60),
    ("HERMES_BATCH_TTL", "120", "batch.ttl", 120),
    ("HERMES_BATCH_WINDOW", "50", "batch.window", 50),
    ("HERMES_KEEP_HISTORY", "1", "workers.keep_history", True),
    ("HERMES_GC_THRESHOLD", "1000,5", "workers.gc_threshold", (1000, 5)),
    ("HERMES_BATCH_SHARE", "0.25", "fairness.batch_share", 0.25),
    ("HERMES_QUEUE_SIZE_PER_KEY", "40", "fairness.queue_size_per_key", 40),
    ("HERMES_METRICS_PORT", "9464", "workers.metrics_port", 9464),
    ("HERMES_METRICS_HOST", "0.0.0.0", "workers.metrics_host", "0.0.0.0"),
    ("HERMES_RUN_REGISTRY", "1", "workers.run_registry", True),
    ("HERMES_API_TOKEN", "t0ken", "api.token", "t0ken"),
    ("HERMES_API_MAX_BODY", "4096", "api.max_body", 4096),
    ("HERMES_API_BODY_TIMEOUT", "2", "api.body_timeout", 2.0),
    ("HERMES_API_HEADER_TIMEOUT", "3", "api.header_timeout", 3.0),
    ("HERMES_API_KEEP_ALIVE", "4", "api.keep_alive", 4.0),
    ("HERMES_API_MAX_CONNECTIONS", "10", "api.max_connections", 10),
    ("HERMES_API_ALLOWED_HOSTS", "gw.internal, Metrics.Lan", "api.allowed_hosts", frozenset({"gw.internal", "metrics.lan"})),
    ("HERMES_TRACE", "Console", "telemetry.trace", "console"),
    ("HERMES_LEAN_SPANS", "0", "telemetry.lean_spans", False),
    ("HERMES_TRACE_URL", "http://j/{trace_id}", "console.trace_url", "http://j/{trace_id}"),
    ("HERMES_SAFE_MODE", "yes", "plugin_discovery.safe_mode", True),
    ("HERMES_ENABLE_PROJECT_PLUGINS", "true", "plugin_discovery.project_plugins", True),
    ("HERMES_GATEWAY_URL", "redis://agent:1/3", "agent_plugin.url", "redis://agent:1/3"),
    ("HERMES_GATEWAY_ROUTE_LLM", "1", "agent_plugin.route_llm", True),
    ("HERMES_GATEWAY_PRINCIPAL", "alice", "agent_plugin.principal", "alice"),
    ("HERMES_GATEWAY_TIMEOUT", "30", "agent_plugin.timeout", 30.0),
    ("HERMES_GATEWAY_TOOL_PREFIX", "gw_", "agent_plugin.tool_prefix", "gw_"),
]

PACKAGES = ("broker", "workers", "middleware", "hermes_gateway")
SETTINGS_MODULE = "broker/config.py"
# Reads of the whole environment (or of one named at run time) that are not settings: where, and why.
NOT_SETTINGS = {
    ("workers/executors/command.py", "build_env"): "a command tool's child process gets its allow-listed variables",
    ("workers/executors/__init__.py", "expand_spec"): "${VAR} in a tool spec is user data from the worker's env",
    ("workers/pool.py", "spawn"): "a worker child process inherits this process's environment",
    ("workers/pool.py", "metrics_env"): "a pool child's environment: this one's, with its own metrics port",
    ("hermes_gateway/local.py", "start_workers"): "a command's own worker processes inherit its environment",
    ("hermes_gateway/demo.py", "run_demo"): "the demo's worker processes inherit its environment",
    ("workers/otelsdk.py", "trace_mode"): "the OpenTelemetry SDK's OTEL_* variables, not ours",
    # middleware imports nothing of ours (no Settings): it finds config.yaml as Hermes does.
    ("middleware/manifest.py", "resolve_home"): "HERMES_HOME, to find config.yaml itself",
}


def attribute(settings: Settings, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(("name", "raw", "path", "expected"), VARIABLES, ids=[v[0] for v in VARIABLES])
def test_each_variable_sets_its_setting(tmp_path: Path, name: str, raw: str, path: str, expected: Any) -> None:
    assert attribute(load_settings(tmp_path, environ={}), path) != expected
    assert attribute(load_settings(tmp_path, environ={name: raw}), path) == expected


def test_without_a_home_the_environment_names_it(tmp_path: Path) -> None:
    assert load_settings(environ={"HERMES_HOME": str(tmp_path)}).home == tmp_path
    assert load_settings(environ={}).home == Path("~/.hermes").expanduser()


def _readme_table() -> list[tuple[str, str, str]]:
    """(variable, config.yaml key, Settings attribute) of each row of the configuration table (docs/configuration.md,
    which the README links)."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    row = re.compile(r"^\| `(HERMES_[A-Z0-9_]+)` \| (?:`([^`]+)`)? *\| `([a-z_.]+)` \|", re.M)
    return [(m.group(1), m.group(2) or "", m.group(3)) for m in row.finditer(text)]


def test_the_readme_table_lists_every_variable_and_the_setting_it_sets() -> None:
    table = {name: path for name, _, path in _readme_table()}
    assert table == {"HERMES_HOME": "home", **{name: path for name, _, path, _ in VARIABLES}}
    read = set()
    for module in ("broker/config.py", "broker/settings.py"):
        read |= set(re.findall(r"HERMES_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_*])", (REPO / module).read_text(encoding="utf-8")))
    assert read == set(table)


# A config.yaml value for each variable that has a key, other than the variable's own in VARIABLES.
IN_FILE = {
    "HERMES_REDIS_URL": "redis://cfg:1/0",
    "HERMES_REDIS_FAST_PATH": "on",
    "HERMES_WAIT_REPLICAS": "1",
    "HERMES_WAIT_TIMEOUT_MS": "900",
    "HERMES_MAX_ARGS": "5000",
    "HERMES_LOG_LEVEL": "error",
    "HERMES_LOG_FORMAT": "console",
    "HERMES_LEASE": "9",
    "HERMES_MAX_ATTEMPTS": "2",
    "HERMES_RESULT_TTL": "99",
    "HERMES_BATCH_SHARE": "0.5",
    "HERMES_QUEUE_SIZE_PER_KEY": "7",
    "HERMES_BATCH_TTL": "77",
    "HERMES_BATCH_WINDOW": "7",
    "HERMES_KEEP_HISTORY": "off",
    "HERMES_TRACE_URL": "http://cfg/{trace_id}",
    "HERMES_GATEWAY_URL": "redis://cfg:1/1",
    "HERMES_GATEWAY_ROUTE_LLM": "0",
    "HERMES_GATEWAY_PRINCIPAL": "bob",
    "HERMES_GATEWAY_TIMEOUT": "99",
    "HERMES_GATEWAY_TOOL_PREFIX": "cfg_",
}


def _config(key: str, value: str) -> dict[str, Any]:
    *parents, leaf = key.split(".")
    config: dict[str, Any] = {leaf: value}
    for parent in reversed(parents):
        config = {parent: config}
    return config


def test_each_config_yaml_key_of_the_table_sets_its_setting_and_its_variable_wins(tmp_path: Path) -> None:
    samples = {name: (raw, expected) for name, raw, _, expected in VARIABLES}
    keyed = [(name, key, path) for name, key, path in _readme_table() if key]
    assert {name for name, _, _ in keyed} == set(IN_FILE)
    for name, key, path in keyed:
        raw, expected = samples[name]
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(_config(key, raw)))
        assert attribute(load_settings(tmp_path, environ={}), path) == expected, key
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(_config(key, IN_FILE[name])))
        assert attribute(load_settings(tmp_path, environ={}), path) != expected, key
        assert attribute(load_settings(tmp_path, environ={name: raw}), path) == expected, name


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"HERMES_LOG_LEVEL": "loud"}, "HERMES_LOG_LEVEL: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
        ({"HERMES_WORKER_LOG_LEVEL": "loud"}, "HERMES_WORKER_LOG_LEVEL: expected one of DEBUG"),
        ({"HERMES_LEASE": "long"}, "HERMES_LEASE: expected a number, got 'long'"),
        ({"HERMES_REDIS_FAST_PATH": "maybe"}, "broker.fast_path (HERMES_REDIS_FAST_PATH): expected true or false"),
        ({"HERMES_MAX_ARGS": "0"}, "broker.max_args / HERMES_MAX_ARGS: expected a number of bytes > 0"),
        ({"HERMES_WAIT_REPLICAS": "1.5"}, "broker.wait_replicas: expected a whole number of replicas >= 0"),
        ({"HERMES_GC_THRESHOLD": "0"}, "HERMES_GC_THRESHOLD must be one to three integers"),
        ({"HERMES_METRICS_PORT": "http"}, "HERMES_METRICS_PORT: expected a port number, got 'http'"),
        ({"HERMES_TRACE": "jaeger"}, "HERMES_TRACE: expected one of off, console, otlp, zipkin, memory, got 'jaeger'"),
        ({"HERMES_GATEWAY_TIMEOUT": "soon"}, "HERMES_GATEWAY_TIMEOUT / plugins.entries.hermes-gateway.timeout"),
        ({"HERMES_GATEWAY_TIMEOUT": "-1"}, "HERMES_GATEWAY_TIMEOUT / plugins.entries.hermes-gateway.timeout"),
        ({"HERMES_GATEWAY_TIMEOUT": "nan"}, "timeout: expected a number of seconds more than 0, got 'nan'"),
        ({"HERMES_BATCH_SHARE": "2"}, "fairness.batch_share (HERMES_BATCH_SHARE): expected a share from 0 to 1"),
        ({"HERMES_QUEUE_SIZE_PER_KEY": "1.5"}, "fairness.queue_size_per_key (HERMES_QUEUE_SIZE_PER_KEY): expected a whole"),
        ({"HERMES_LEASE": "-5"}, "workers.lease (HERMES_LEASE): expected seconds above 0, got -5"),
        ({"HERMES_MAX_ATTEMPTS": "0"}, "workers.max_attempts (HERMES_MAX_ATTEMPTS): expected a whole number of at least 1"),
        ({"HERMES_MAX_ATTEMPTS": "2.7"}, "expected a whole number of at least 1, got 2.7"),
        ({"HERMES_RESULT_TTL": "0"}, "workers.result_ttl (HERMES_RESULT_TTL): expected whole seconds of at least 1"),
        ({"HERMES_LOG_FORMAT": "xml"}, "logging.format (HERMES_LOG_FORMAT): expected console or json, got 'xml'"),
        ({"HERMES_LEAN_SPANS": "maybe"}, "lean spans (HERMES_LEAN_SPANS): expected true or false, got 'maybe'"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_its_variable(
    tmp_path: Path, environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(tmp_path, environ=environ)
    assert message in str(info.value)


def test_the_model_and_mcp_sections_are_typed_with_their_defaults(tmp_path: Path) -> None:
    defaults = load_settings(tmp_path, environ={})
    assert (defaults.model.provider, defaults.model.timeout, defaults.model.max_retries) == ("", 120.0, 2)
    assert (defaults.model.max_retry_after, defaults.mcp.handshake_timeout) == (60.0, None)
    assert "handshake_timeout" not in defaults.executor_settings("mcp")
    (tmp_path / "config.yaml").write_text(
        "model: {provider: ollama, model: qwen, base_url: 'http://h:1/v1', api_key: '${KEY}', api_mode: x,\n"
        "        timeout: 7, max_retries: 4, max_retry_after: 3, headers: {X-A: 1}, default: hermes-own}\n"
        "mcp: {handshake_timeout: 30}\n"
        "executors: {mcp: {concurrency: 2}}\n"
    )
    settings = load_settings(tmp_path, environ={"KEY": "sk-secret"})
    model = settings.model
    assert (model.provider, model.model, model.base_url, model.api_key, model.api_mode) == (
        "ollama", "qwen", "http://h:1/v1", "sk-secret", "x"
    )
    assert (model.timeout, model.max_retries, model.max_retry_after, model.headers) == (7.0, 4, 3.0, {"X-A": "1"})
    assert "sk-secret" not in repr(settings)  # the key is kept out of logs of the settings
    assert settings.executor_settings("mcp") == {"handshake_timeout": 30.0, "concurrency": 2}


def test_a_model_named_alone_is_hermes_spelling_of_model_model(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("model: anthropic/claude-sonnet-4\n")
    assert load_settings(tmp_path, environ={}).model.model == "anthropic/claude-sonnet-4"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: {timeout: soon}", "config.yaml: model.timeout: expected a number"),
        ("model: {max_retries: 1.5}", "config.yaml: model.max_retries: expected a whole number"),
        ("model: {headers: [a]}", "config.yaml: model.headers: expected a mapping"),
        ("mcp: {handshake_timeout: never}", "config.yaml: mcp.handshake_timeout: expected a number"),
        ("mcp: {servers: {}}", "config.yaml: mcp: unknown key(s) ['servers']"),
        ("model: [fast]", "config.yaml: model: expected a mapping"),
        # A limit of 0 would leave every call of the executor waiting for a slot forever.
        ("executor: {concurrency: 0}", "config.yaml: executor.concurrency: expected an integer of at least 1, got 0"),
        ("executors: {http: {concurrency: 2.5}}", "config.yaml: executors.http.concurrency: expected an integer"),
        ("executors: {mcp: {queue_size: -1}}", "config.yaml: executors.mcp.queue_size: expected an integer of at least 0"),
        ("executor: {queue_size: many}", "config.yaml: executor.queue_size: expected an integer"),
        # The breaker every tool of the kind gets: a bad value failed each of their calls as internal_error.
        ("executors: {http: {breaker: {cooldown: 30s}}}", "executors.http: breaker.cooldown: expected a number"),
        ("executor: {breaker: {failure: 3}}", "executor: breaker.failure: unknown key (did you mean 'failures'?)"),
    ],
)
def test_a_bad_model_or_mcp_key_is_a_config_error_naming_it(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "config.yaml").write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load_settings(tmp_path, environ={})
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("executor: {concurency: 3}", "executor.concurency is not a setting (did you mean executor.concurrency?)"),
        ("executors: {http: {queue_sise: 9}}",
         "executors.http.queue_sise is not a setting (did you mean executors.http.queue_size?)"),
        ("broker: {urll: 'redis://h'}", "broker.urll is not a setting (did you mean broker.url?)"),
        ("workers: {max_atempts: 5}", "workers.max_atempts is not a setting (did you mean workers.max_attempts?)"),
        ("batch: {windw: 5}", "batch.windw is not a setting (did you mean batch.window?)"),
        ("console: {trace-url: x}", "console.trace-url is not a setting (did you mean console.trace_url?)"),
        ("api: {tokns: {}}", "api.tokns is not a setting (did you mean api.tokens?)"),
        ("telemetry: {trace: otlp}", "telemetry.trace is not a setting (known: none, HERMES_* variables set it)"),
        ("plugins: {entries: {hermes-gateway: {rout_llm: true}}}",
         "plugins.entries.hermes-gateway.rout_llm is not a setting "
         "(did you mean plugins.entries.hermes-gateway.route_llm?)"),
    ],
)
def test_a_mistyped_key_of_a_section_of_ours_is_named_with_the_nearest_one(
    tmp_path: Path, text: str, message: str
) -> None:
    (tmp_path / "config.yaml").write_text(text + "\n")
    assert load_settings(tmp_path, environ={}).unknown_keys == (f"config.yaml: {message}",)


def test_hermes_own_keys_and_an_executors_own_settings_are_not_named(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(
        "model: {default: m, provider: openai}\nterminal: {backend: docker}\n"
        "mcp: {auto_reload_on_config_change: false}\n"
        "plugins: {enabled: [x], entries: {other: {colour: red}, hermes-gateway: {route_llm: true, timeout: 5}}}\n"
        "executor: {concurrency: 3, breaker: {failures: 2}, max_output: 100}\n"
        "executors: {http: {allow_hosts: [a], body_template: x, queue_size: 5}, python: {inline: [], paths: []}}\n"
        "broker: {url: 'redis://h', max_args: 10}\nworkers: {lease: 5, shortcuts_off: []}\nconsole: {trace_url: x}\n"
    )
    assert load_settings(tmp_path, environ={}).unknown_keys == ()


def test_every_setting_has_an_environment_override(tmp_path: Path) -> None:
    """DESIGN.md: every setting has an environment override. HERMES__<SECTION>__<KEY>... names any
    config.yaml key, its value read as YAML, over the file; the named variables still win."""
    (tmp_path / "config.yaml").write_text(
        "executors: {http: {concurrency: 2}}\nmodel: {base_url: http://file}\nbroker: {max_args: 1000}\n"
    )
    env = {
        "HERMES__EXECUTORS__HTTP__CONCURRENCY": "10",
        "HERMES__EXECUTORS__HTTP__ALLOW_HOSTS": "[api.test, 127.0.0.1]",
        "HERMES__MODEL__BASE_URL": "http://env:8000/v1",
        "HERMES__AUDIT__MAXLEN": "500",
        "HERMES__MCP__HANDSHAKE_TIMEOUT": "30",
        "HERMES__BROKER__MAX_ARGS": "2000",
        "HERMES_MAX_ARGS": "3000",
    }
    settings = load_settings(tmp_path, environ=env)
    assert settings.concurrency_for("http") == 10
    assert settings.executor_settings("http")["allow_hosts"] == ["api.test", "127.0.0.1"]
    assert settings.model.base_url == "http://env:8000/v1" and settings.audit.maxlen == 500
    assert settings.executor_settings("mcp")["handshake_timeout"] == 30.0
    assert settings.broker.max_args == 3000  # (HERMES_MAX_ARGS, the named variable, wins)
    with pytest.raises(ConfigError, match="executors.http.concurrency: expected an integer of at least 1"):
        load_settings(tmp_path, environ={"HERMES__EXECUTORS__HTTP__CONCURRENCY": "0"})  # checked as the file is
    with pytest.raises(ConfigError, match="HERMES__MODEL__: expected HERMES__<SECTION>__<KEY>"):
        load_settings(tmp_path, environ={"HERMES__MODEL__": "x"})


def test_executor_limits_from_a_variable_are_numbers(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("executor: {concurrency: '${LIMIT}', queue_size: 0}\n")
    settings = load_settings(tmp_path, environ={"LIMIT": "3"})
    assert (settings.concurrency_for("http"), settings.queue_size_for("http")) == (3, 0)


@pytest.mark.parametrize("raw", ["lots", "0", "-3", ""])
def test_a_bad_http_bound_keeps_its_default(tmp_path: Path, raw: str) -> None:
    api = load_settings(tmp_path, environ={"HERMES_API_MAX_BODY": raw, "HERMES_API_HEADER_TIMEOUT": raw}).api
    assert (api.max_body, api.header_timeout) == (32 * 1024 * 1024, 10.0)


def test_the_plugin_discovery_reads_config_yaml_as_the_gateway_does(tmp_path: Path) -> None:
    # The seed's unquoted {{field}} templates are not plain YAML: the gateway's reader keeps them as text.
    write_plugin(tmp_path, "tagger", "def register(ctx):\n    pass\n")
    enable_plugin(tmp_path, "tagger")
    with (tmp_path / "config.yaml").open("a") as fh:
        fh.write("executors:\n  http:\n    body_template: {query: {{city}}}\n")
    manager = PluginManager(tmp_path, discovery=load_settings(tmp_path, environ={}).plugin_discovery)
    assert [i.key for i in manager.load() if i.enabled] == ["tagger"]
    with pytest.raises(yaml.YAMLError):
        PluginManager(tmp_path, discovery=PLAIN).load()


def test_importing_our_packages_reads_no_setting(tmp_path: Path) -> None:
    # Bad values everywhere: a module that read (and checked) one at import would fail to import.
    bad = {name: "@bad@" for name, *_ in VARIABLES}
    code = (
        "import importlib, pkgutil\n"
        f"for package in {PACKAGES!r}:\n"
        "    module = importlib.import_module(package)\n"
        "    for info in pkgutil.walk_packages(module.__path__, package + '.'):\n"
        "        if not info.name.endswith('__main__'):\n"
        "            importlib.import_module(info.name)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **bad}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


# -- no module reads a HERMES_* variable itself ------------------------------------------------------


def _of_os(node: ast.AST, *names: str) -> bool:
    """``os.<name>`` for one of ``names``."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr in names
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _key(node: ast.AST | None) -> str | None:
    """The variable name a read asks for when the source spells it (a literal, or an f-string's start)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def environment_reads(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, enclosing function, variable name if spelled) of each read of ``os.environ`` / ``os.getenv``
    in one module; writes (``os.environ[name] = ...``, for child processes) are not reads."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def function_of(node: ast.AST) -> str:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                return node.name
        return "<module>"

    reads: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            names = {a.name for a in node.names} & {"environ", "getenv", "getenvb", "environb"}
            reads.extend((node.lineno, function_of(node), None) for _ in names)
        getenv = _of_os(node, "getenv", "getenvb")
        if not (getenv or _of_os(node, "environ", "environb")):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store | ast.Del):
            continue  # setting up the environment of child processes
        key = None
        if isinstance(parent, ast.Subscript):
            key = _key(parent.slice)
        elif isinstance(parent, ast.Call) and getenv:
            key = _key(parent.args[0] if parent.args else None)
        elif isinstance(parent, ast.Attribute) and parent.attr == "get":
            call = parents.get(parent)
            key = _key(call.args[0] if isinstance(call, ast.Call) and call.args else None)
        reads.append((node.lineno, function_of(node), key))
    return sorted(reads, key=lambda r: r[0])


def test_no_module_reads_a_hermes_variable_but_the_settings() -> None:
    found, used = [], set()
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            where = path.relative_to(REPO).as_posix()
            if where == SETTINGS_MODULE:
                continue
            for line, function, key in environment_reads(path):
                if key is not None and not key.startswith("HERMES_"):
                    continue  # another program's variable (OTEL_*), spelled out
                if (where, function) in NOT_SETTINGS:
                    used.add((where, function))
                    continue
                found.append(f"{where}:{line} ({function}) reads {key or 'the environment'}")
    assert found == [], "read it through Settings (broker/config.py), or say why not in NOT_SETTINGS"
    assert used == set(NOT_SETTINGS), "an exception no longer needed: take it off NOT_SETTINGS"


def test_the_guard_sees_each_way_of_reading(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\n"
        "def a():\n    return os.environ.get('HERMES_X')\n"
        "def b():\n    return os.environ['HERMES_Y']\n"
        "def c():\n    return os.getenv(NAME)\n"
        "def d():\n    return dict(os.environ)\n"
        "def e():\n    os.environ['HERMES_Z'] = '1'\n"
        "def f():\n    return os.environ.get(f'OTEL_{x}')\n"
    )
    assert environment_reads(sample) == [
        (3, "a", "HERMES_X"),
        (5, "b", "HERMES_Y"),
        (7, "c", None),
        (9, "d", None),
        (13, "f", "OTEL_"),
    ]


def test_fairness_weights_are_per_principal_positive_numbers(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"fairness": {"weights": {"alice": 2, "batch-7": 0.5}}}))
    fairness = load_settings(tmp_path, environ={}).fairness
    assert fairness.weight_of("alice", "anything") == 2 and fairness.weight_of(None, "batch-7") == 0.5
    assert fairness.weight_of("bob", "bob") == 1.0 and fairness.queue_size_per_key is None
    for bad in ({"weights": {"alice": 0}}, {"weights": ["alice"]}, {"wieghts": {}}):
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"fairness": bad}))
        with pytest.raises(ConfigError, match="fairness"):
            load_settings(tmp_path, environ={})


def test_an_unset_variable_in_config_yaml_reads_empty_and_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(
        "model: {base_url: 'http://h/v1', api_key: '${NOPE_KEY}', model: '${NOPE_MODEL:-m1}'}\n"
        "# api_key: ${COMMENTED_OUT}\n"
        "executors: {http: {headers: ['${NOPE_TOKEN}']}}\n"
    )
    settings = load_settings(tmp_path, environ={})
    assert settings.model.api_key == "" and settings.model.model == "m1"  # (a :-default is no omission)
    assert settings.model.api_key_unset == "NOPE_KEY"
    assert settings.unset_vars == (("model.api_key", "NOPE_KEY"), ("executors.http.headers[0]", "NOPE_TOKEN"))
    found = load_settings(tmp_path, environ={"NOPE_KEY": "sk-1", "NOPE_TOKEN": "t"})
    assert found.unset_vars == () and found.model.api_key == "sk-1" and found.model.api_key_unset == ""
    # A HERMES__ variable that sets the key the file left to an unset ${VAR}: nothing reads empty.
    overridden = load_settings(tmp_path, environ={"HERMES__MODEL__API_KEY": "sk-2"})
    assert overridden.model.api_key == "sk-2" and overridden.model.api_key_unset == ""
    assert overridden.unset_vars == (("executors.http.headers[0]", "NOPE_TOKEN"),)


def test_a_mistyped_logging_key_is_named_with_the_nearest_one(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("logging:\n  levle: DEBUG\n  format: json\n  colour: red\n")
    settings = load_settings(tmp_path, environ={})
    assert settings.logging.level == "INFO"  # (the typo set nothing)
    assert settings.unknown_keys == (
        "config.yaml: logging.levle is not a setting (did you mean logging.level?)",
        "config.yaml: logging.colour is not a setting (known: level, format)",
    )
    from click.testing import CliRunner

    from hermes_gateway.cli import main

    out = CliRunner().invoke(main, ["--home", str(tmp_path), "tool", "--help"])
    assert "logging.levle is not a setting (did you mean logging.level?)" in out.output
