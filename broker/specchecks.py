"""Registration-time checks of a tool spec: JSON Schemas, retry/breaker keys, each executor's own keys.

Every error names the field path (``input_schema.properties.city.type``, ``retry.backoff``) and what
was expected, because the person reading it is editing a YAML file.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from .errors import InvalidSpec
from .specstatic import _fail, check_placeholders, check_static
from .toolspec import COMMON_KEYS

# Keys every spec may carry (kept out of ``ToolSpec.config``), and ``queue``, which routing reads.
ROUTING_KEYS = frozenset({"queue", "queue_partitions"})

# Each executor's own keys, as its module docstring in workers/executors/ documents them.
EXECUTOR_KEYS: dict[str, frozenset[str]] = {
    "command": frozenset(
        {"command", "args_separator", "env", "env_set", "cwd", "stdin", "output", "max_output", "kill_grace"}
    ),
    "http": frozenset(
        {
            "endpoint",
            "url",
            "method",
            "headers",
            "send_args_as",
            "body_template",
            "allow_hosts",
            "allow_networks",
            "max_output",
            "max_redirects",
            "verify",
        }
    ),
    "python": frozenset({"function"}),
    "database": frozenset({"dsn", "query", "mode", "tables", "read_only", "max_rows"}),
    "grpc": frozenset({"target", "tls", "method", "metadata", "max_output"}),
    # mcp_server: the label ``mcp add`` gave the server the tool came from (``mcp remove`` finds it by that);
    # unwrap_result: the server wraps a non-object return as {"result": ...} (``mcp add`` sets it).
    "mcp": frozenset({"mcp", "server", "tool", "handshake_timeout", "max_output", "mcp_server", "unwrap_result"}),
}

_NUMBER = "a number >= 0"
# key -> (check, what was expected)
_RETRY: dict[str, tuple[Any, str]] = {
    "max": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (attempts after the first)"),
    "backoff": (lambda v: _is_num(v) and v >= 0, f"{_NUMBER} of seconds"),
    "max_backoff": (lambda v: _is_num(v) and v >= 0, f"{_NUMBER} of seconds"),
    "jitter": (
        lambda v: isinstance(v, bool) or (_is_num(v) and 0 <= v <= 1),
        "true/false or a fraction 0..1",
    ),
    "factor": (lambda v: _is_num(v) and v >= 1, "a number >= 1 (backoff growth per attempt)"),
    "on": (
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
        "an error type or a list of error types (e.g. [executor_error, tool_timeout])",
    ),
}
_BREAKER: dict[str, tuple[Any, str]] = {
    "failures": (lambda v: _is_int(v) and v >= 1, "an integer >= 1 (consecutive failures that open it)"),
    "cooldown": (lambda v: _is_num(v) and v > 0, "a number of seconds > 0"),
    "rate": (lambda v: _is_num(v) and 0 < v <= 1, "a failure ratio 0 < rate <= 1"),
    "window": (lambda v: _is_num(v) and v > 0, "a number of seconds > 0"),
    "min_calls": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "key": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "on": _RETRY["on"],
}
_JSON_TYPES = "string, number, integer, boolean, object, array, null"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_strict(
    where: str,
    executor: str,
    data: Mapping[str, Any],
    schema: dict[str, Any],
    out_schema: dict[str, Any] | None,
) -> None:
    """Everything ``ToolSpec.from_dict`` checks beyond field types; raises InvalidSpec."""
    check_keys(where, executor, data)
    check_schema(where, "input_schema", schema)
    if schema.get("type", "object") != "object":
        raise _fail(
            where, "input_schema.type", f'expected "object" (arguments are a mapping), got {schema["type"]!r}'
        )
    if out_schema is not None:
        check_schema(where, "output_schema", out_schema)
    for key, rules in (("retry", _RETRY), ("breaker", _BREAKER)):
        if isinstance(data.get(key), dict):
            check_options(where, key, data[key], rules)
    check_required(where, executor, data)
    check_static(where, executor, data)
    check_placeholders(where, executor, data, schema)


def check_keys(where: str, executor: str, data: Mapping[str, Any]) -> None:
    known = COMMON_KEYS | ROUTING_KEYS | EXECUTOR_KEYS[executor]
    for key in data:
        if key in known:
            continue
        hint = difflib.get_close_matches(str(key), known, n=1)
        maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise InvalidSpec(
            f"{where}: {key}: unknown key for a {executor} tool{maybe}; known keys: {', '.join(sorted(known))}",
            path=str(key),
        )


def check_schema(where: str, field: str, schema: dict[str, Any]) -> None:
    """``schema`` must be valid JSON Schema 2020-12; the error names the path inside it."""
    error = best_match(Draft202012Validator(Draft202012Validator.META_SCHEMA).iter_errors(schema))
    if error is None:
        return
    path = ".".join([field, *(str(p) for p in error.absolute_path)])
    if error.absolute_path and error.absolute_path[-1] == "type":
        expected = f"expected a JSON Schema type ({_JSON_TYPES}) or a list of them, got {error.instance!r}"
    else:
        expected = f"not valid JSON Schema 2020-12: {error.message}"
    raise _fail(where, path, expected)


def check_options(
    where: str, section: str, value: Mapping[str, Any], rules: Mapping[str, tuple[Any, str]]
) -> None:
    for key, val in value.items():
        if key not in rules:
            hint = difflib.get_close_matches(str(key), rules, n=1)
            maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise _fail(where, f"{section}.{key}", f"unknown key{maybe}; known keys: {', '.join(rules)}")
        check, expected = rules[key]
        if not check(val):
            raise _fail(where, f"{section}.{key}", f"expected {expected}, got {val!r}")


def check_required(where: str, executor: str, data: Mapping[str, Any]) -> None:
    def need(keys: Iterable[str], expected: str) -> None:
        if not any(data.get(k) not in (None, "") for k in keys):
            raise _fail(where, next(iter(keys)), f"required for a {executor} tool: {expected}")

    if executor == "command":
        need(["command"], "the program and its arguments, e.g. `echo Hello, {{name}}!`")
    elif executor == "http":
        need(["endpoint", "url"], "the URL to call, e.g. http://host/path/{{id}}")
    elif executor == "python":
        need(["function"], '"package.module:callable"')
    elif executor == "database":
        if data.get("mode") == "structured":
            need(["tables"], "with mode: structured, the allow-list {table: [columns]}")
        else:
            need(["query"], "the SQL with :named parameters (or `mode: structured` with `tables`)")
    elif executor == "grpc":
        need(["method"], "package.Service/Method")
    elif executor == "mcp":
        need(["mcp", "server"], "the server: {command: [...]} | {url: ...} | {server: name}")


# -- static checks of each executor's own keys -------------------------------------------------------
