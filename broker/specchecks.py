"""Registration-time checks of what every tool spec has: JSON Schemas, retry and breaker options.

Every error names the field path (``retry.backoff``) and what was expected: its reader is editing YAML.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from .errors import InvalidSpec
from .ratelimits import RateLimit

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
    where: str, data: Mapping[str, Any], schema: dict[str, Any], out_schema: dict[str, Any] | None
) -> None:
    """Everything ``ToolSpec.from_dict`` checks beyond field types; raises InvalidSpec."""
    check_schema(where, "input_schema", schema)
    if schema.get("type", "object") != "object":
        raise InvalidSpec.at(
            where, "input_schema.type", f'expected "object" (arguments are a mapping), got {schema["type"]!r}'
        )
    if out_schema is not None:
        check_schema(where, "output_schema", out_schema)
    for section in ("retry", "breaker"):
        check_options(where, section, data.get(section))
    rate = RateLimit.parse(where, data.get("rate_limit"))
    parts = data.get("queue_partitions") or 1
    for kind, value in rate.to_dict().items() if rate is not None else ():
        if kind == "tokens_per_minute":  # (a tool call reserves no tokens: it would never be checked)
            raise InvalidSpec.at(where, f"rate_limit.{kind}", "counts LLM tokens: a tool call has none")
        if value < parts:  # (each partition has its share: one of 0 would hold its calls for ever)
            expected = f"expected at least queue_partitions ({parts}): each partition takes a share >= 1, got {value}"
            raise InvalidSpec.at(where, f"rate_limit.{kind}", expected)


def check_options(where: str, section: str, options: Any) -> None:
    """A spec's ``retry:`` or ``breaker:`` mapping (or ``executors.<kind>.breaker``): known keys, good values."""
    rules = {"retry": _RETRY, "breaker": _BREAKER}[section]
    for key, val in options.items() if isinstance(options, dict) else ():
        if key not in rules:
            known = f"known keys: {', '.join(rules)}"
            raise InvalidSpec.at(where, f"{section}.{key}", f"unknown key{_maybe(key, rules)}; {known}")
        check, expected = rules[key]
        if not check(val):
            raise InvalidSpec.at(where, f"{section}.{key}", f"expected {expected}, got {val!r}")


def check_keys(where: str, what: str, data: Mapping[str, Any], known: frozenset[str]) -> None:
    """Every key of ``data`` is one of ``known`` (the error suggests the nearest); ``what``: "a http tool"."""
    for key in data:
        if key not in known:
            expected = f"unknown key for {what}{_maybe(key, known)}; known keys: {', '.join(sorted(known))}"
            raise InvalidSpec.at(where, str(key), expected)


def _maybe(key: Any, known: Iterable[str]) -> str:
    hint = difflib.get_close_matches(str(key), known, n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


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
    raise InvalidSpec.at(where, path, expected)
