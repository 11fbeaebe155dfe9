"""Tool arguments: parse the text a person types, coerce model output as Hermes does, validate.

Coercion follows hermes-agent's ``coerce_tool_args`` (strings become the numbers, booleans, None or JSON
arrays/objects the schema asks for; a bare value where an array is expected becomes ``[value]``) but
recurses into every nested property and item; what does not coerce cleanly is left for validation to
report. Validation tries ``quick_check`` first (``workers.shortcuts_off: [quickcheck]`` turns it off), then
the full Draft 2020-12 validator, which reports every violation.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
import threading
from collections.abc import Callable
from typing import Any, Literal

import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from broker.codec import MAX_DEPTH, WIRE_INTS, nesting
from broker.errors import CallFailed, InvalidArgs, InvalidOutput, InvalidSpec
from broker.settings import shortcut_on as on

_INT = re.compile(r"^\s*[-+]?\d+\s*$")
_MAX_MESSAGE = 300
_CACHE_MAX = 1024

# --- coercion -----------------------------------------------------------------------------------


def coerce_args(schema: dict[str, Any] | None, args: Any) -> Any:
    """Return a coerced copy of ``args`` (the input is never mutated)."""
    if not isinstance(schema, dict) or not isinstance(args, dict):
        return args
    return _coerce(args, schema)


def _types(schema: dict[str, Any]) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    return []


def _allows_null(schema: dict[str, Any]) -> bool:
    if "null" in _types(schema) or schema.get("nullable") is True:
        return True
    return any(
        isinstance(v, dict) and v.get("type") == "null"
        for key in ("anyOf", "oneOf")
        for v in _list(schema.get(key))
    )


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _coerce(value: Any, schema: Any) -> Any:
    if not isinstance(schema, dict):
        return value
    types = _types(schema)
    if isinstance(value, str):
        value = _coerce_string(value, schema, types)
        if isinstance(value, str):
            if "array" in types and "string" not in types:
                return [_coerce(value, schema.get("items"))]
            return value
    if isinstance(value, list):
        if types and "array" not in types:
            return value
        items = schema.get("items")
        prefix = _list(schema.get("prefixItems"))
        return [_coerce(item, prefix[i] if i < len(prefix) else items) for i, item in enumerate(value)]
    if isinstance(value, dict):
        if types and "object" not in types:
            return _wrap(value, schema, types)
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        extra = schema.get("additionalProperties")
        return {k: _coerce(v, props.get(k, extra)) for k, v in value.items()}
    return _wrap(value, schema, types)


def _wrap(value: Any, schema: dict[str, Any], types: list[str]) -> Any:
    """A bare (non-null) value where only an array fits becomes a one-element array."""
    if value is not None and types == ["array"]:
        return [_coerce(value, schema.get("items"))]
    return value


def _coerce_string(value: str, schema: dict[str, Any], types: list[str]) -> Any:
    if _allows_null(schema) and value.strip().lower() == "null":
        return None
    if "string" in types:
        return value  # a string is acceptable as it is; never second-guess it
    for t in types:
        if t in ("integer", "number"):
            out = _coerce_number(value, integer_only=t == "integer")
        elif t == "boolean":
            low = value.strip().lower()
            out = True if low == "true" else False if low == "false" else value
        elif t in ("array", "object"):
            out = _coerce_json(value, list if t == "array" else dict)
        else:
            continue
        if out is not value:
            return out
    return value


def _coerce_number(value: str, integer_only: bool) -> Any:
    if _INT.match(value):
        try:
            n = int(value)  # exact, even past float precision
        except ValueError:  # (more digits than Python converts)
            return value
        return n if n in WIRE_INTS else value  # (past the wire's integers: text, which the schema refuses)
    try:
        f = float(value)
    except (ValueError, OverflowError):
        return value
    if not math.isfinite(f):
        return value
    if f == int(f) and int(f) in WIRE_INTS:
        return int(f)
    return value if integer_only else f


def _coerce_json(value: str, kind: type) -> Any:
    try:
        parsed = json.loads(value)
    except (ValueError, TypeError, RecursionError):
        return value
    return parsed if isinstance(parsed, kind) and nesting(parsed) <= MAX_DEPTH else value  # (deeper: text)


# --- validation ---------------------------------------------------------------------------------

_validators: dict[str, tuple[Draft202012Validator, Quick | None]] = {}
_lock = threading.Lock()


# The last schema objects seen, by identity, so the hot path skips hashing a spec's schema; each is kept
# with its validator so its id is not reused meanwhile. Specs are replaced whole, never edited in place.
_by_id: dict[int, tuple[dict[str, Any], Draft202012Validator, Quick | None]] = {}


def validator_for(schema: dict[str, Any]) -> Draft202012Validator:
    """A cached Draft 2020-12 validator (with format checks); an invalid schema is InvalidSpec."""
    return _compiled(schema)[0]


def _compiled(schema: dict[str, Any]) -> tuple[Draft202012Validator, Quick | None]:
    seen = _by_id.get(id(schema))
    if seen is not None and seen[0] is schema:
        return seen[1], seen[2]
    blob = json.dumps(schema, sort_keys=True, separators=(",", ":"), default=str)
    key = hashlib.sha256(blob.encode()).hexdigest()
    found = _validators.get(key)
    if found is None:
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as e:
            raise InvalidSpec(f"schema is not valid JSON Schema 2020-12: {e.message}") from e
        found = (
            Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER),
            quick_check(schema),
        )
        with _lock:
            if len(_validators) >= _CACHE_MAX:
                _validators.clear()  # specs rarely change; a full reset keeps this simple and bounded
            _validators[key] = found
    with _lock:
        if len(_by_id) >= _CACHE_MAX:
            _by_id.clear()
        _by_id[id(schema)] = (schema, *found)
    return found


def json_path(parts: Any) -> str:
    """``$.a.b[0]``; keys that are not identifiers are quoted: ``$["a b"]``."""
    out = "$"
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and p.isidentifier():
            out += f".{p}"
        else:
            out += f"[{json.dumps(p, ensure_ascii=False)}]"
    return out


def violations(schema: dict[str, Any], instance: Any) -> list[str]:
    """Every way ``instance`` breaks ``schema``, as ``path: message``, sorted by path."""
    found = []
    for err in validator_for(schema).iter_errors(instance):
        path = list(err.absolute_path)
        if err.validator == "required" and isinstance(err.instance, dict):
            missing = [n for n in err.validator_value if n not in err.instance and repr(n) in err.message]
            if missing:
                path.append(missing[0])
        message = err.message if len(err.message) <= _MAX_MESSAGE else err.message[: _MAX_MESSAGE - 3] + "..."
        found.append((json_path(path), message))
    found.sort()
    return [f"{p}: {m}" for p, m in found]


def validate_args(schema: dict[str, Any] | None, args: Any, tool: str | None = None) -> None:
    """Raise InvalidArgs listing every violation (``details.violations``) if ``args`` do not fit."""
    _refuse(InvalidArgs, "invalid arguments", schema, args, tool)


def check_output(schema: dict[str, Any] | None, result: Any, tool: str | None = None) -> None:
    """Raise InvalidOutput listing every violation if the tool's result does not fit its output schema."""
    _refuse(InvalidOutput, "result does not match the output schema", schema, result, tool)


def _refuse(error: type[CallFailed], what: str, schema: dict[str, Any] | None, value: Any, tool: str | None) -> None:
    if not schema or ((quick := _compiled(schema)[1]) is not None and quick(value)):
        return
    if problems := violations(schema, value):
        where = f"tool {tool!r}: " if tool else ""
        raise error(f"{where}{what}: " + "; ".join(problems), violations=problems)


# --- parsing what a person types -----------------------------------------------------------------


class _ArgsLoader(yaml.SafeLoader):
    """YAML 1.2-ish scalars: only true/false are booleans, dates stay strings (yes/no/on are text)."""


_ArgsLoader.yaml_implicit_resolvers = {
    first: [
        (tag, rx)
        for tag, rx in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ArgsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml_text(text: str) -> Any:
    """Parse YAML (or JSON) text with the argument loader's scalar rules; raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_ArgsLoader)  # noqa: S506 - a SafeLoader subclass


def _where(error: yaml.YAMLError, json_error: json.JSONDecodeError) -> str:
    """One line naming what is wrong and where (PyYAML's own message spans several lines with carets)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None)
    if mark is None or not problem:
        return f"{json_error.msg} at line {json_error.lineno}, column {json_error.colno}"
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def parse_args_text(text: str | None, schema: Any = None) -> dict[str, Any]:
    """Arguments typed on a command line: JSON, or the YAML flow form the seed prints (``{name: Alice}``).
    In the YAML form, a value ``schema`` wants as a string stays the text typed (``{zip: 02134}``,
    ``{code: 1.50}``), where YAML alone would read a number."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as json_error:
        try:
            value = load_yaml_text(text)
        except yaml.YAMLError as e:
            raise InvalidArgs(f"arguments are neither JSON nor YAML: {_where(e, json_error)}") from e
        if schema is not None:
            value = _as_typed(value, yaml.load(text, Loader=yaml.BaseLoader), schema)  # noqa: S506 - text only
    if not isinstance(value, dict):
        raise InvalidArgs(f'arguments must be a mapping like {{"name": "Alice"}}, got {type(value).__name__}')
    return {str(k): v for k, v in value.items()}


def _as_typed(value: Any, text: Any, schema: Any) -> Any:
    """``value`` (YAML's reading) with the scalar ``text`` typed in its place wherever ``schema`` wants a
    string and not a number or boolean."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict) and isinstance(text, dict):
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        extra = schema.get("additionalProperties")
        return {k: _as_typed(v, text.get(str(k)), props.get(str(k), extra)) for k, v in value.items()}
    if isinstance(value, list) and isinstance(text, list) and len(value) == len(text):
        return [_as_typed(v, t, schema.get("items")) for v, t in zip(value, text, strict=True)]
    types = _types(schema)
    if (
        isinstance(text, str) and value is not None and not isinstance(value, str | dict | list)
        and "string" in types and not {"integer", "number", "boolean"} & set(types)
    ):
        return text
    return value


# --- the quick check ------------------------------------------------------------------------------

Quick = Callable[[Any], bool]

_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
)
_KNOWN = _ANNOTATIONS | {
    "type", "properties", "required", "additionalProperties", "items", "enum", "const",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "minItems", "maxItems",
}  # fmt: skip


def _is_integer(v: Any) -> bool:
    t = type(v)
    return t is int or (t is float and v.is_integer())


_TYPE_TESTS: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: type(v) is dict,
    "array": lambda v: type(v) is list,
    "string": lambda v: type(v) is str,
    "integer": _is_integer,
    "number": lambda v: type(v) is int or type(v) is float,
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
}
_NUMBER = (int, float)
_BOUNDS = {
    "minimum": operator.ge,
    "maximum": operator.le,
    "exclusiveMinimum": operator.gt,
    "exclusiveMaximum": operator.lt,
}
_SCALARS = (str, int, float, bool, type(None))


def quick_check(schema: Any) -> Quick | None:
    """A check that returns True only for instances ``schema`` accepts (None: no quick check for it).

    Only plain JSON data (exact types, as msgpack and json decode them) is judged; anything else (a
    Decimal, an IntEnum, a str subclass) is "not sure", as is ``True == 1`` or ``1 == 1.0``.
    """
    check = _compile(schema)
    if check is None:
        return None
    return lambda v: on("quickcheck") and _plain(v) and check(v)


def _plain(value: Any, depth: int = 0) -> bool:
    kind = type(value)
    if kind in _SCALARS:
        return True
    if depth > 32:
        return False
    if kind is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    if kind is list:
        return all(_plain(v, depth + 1) for v in value)
    return False


def _compile(schema: Any) -> Quick | None:
    if schema is True:
        return _anything
    if not isinstance(schema, dict) or not _KNOWN.issuperset(schema):
        return None
    checks: list[Quick] = []
    for part in (_type_check, _value_check, _bounds_check, _size_check, _items_check, _object_check):
        made = part(schema)
        if made is False:
            return None
        if made is not None:
            checks.append(made)
    if not checks:
        return _anything
    if len(checks) == 1:
        return checks[0]
    parts = tuple(checks)
    return lambda v: all(c(v) for c in parts)


def _anything(_v: Any) -> bool:
    return True


# Each part: None when the schema has none of its keywords, False when it has them in a form not covered.
_Part = Quick | None | Literal[False]


def _type_check(schema: dict[str, Any]) -> _Part:
    kind = schema.get("type")
    if kind is None:
        return None
    names = [kind] if isinstance(kind, str) else kind
    if not isinstance(names, list) or not names or any(n not in _TYPE_TESTS for n in names):
        return False
    tests = [_TYPE_TESTS[n] for n in names]
    if len(tests) == 1:
        return tests[0]
    return lambda v: any(t(v) for t in tests)


def _value_check(schema: dict[str, Any]) -> _Part:
    if "enum" not in schema and "const" not in schema:
        return None
    if "enum" in schema and "const" in schema:
        return False
    allowed = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(allowed, list) or any(type(a) not in _SCALARS for a in allowed):
        return False
    plain = [(type(a), a) for a in allowed]
    return lambda v: any(type(v) is t and v == a for t, a in plain)


def _bounds_check(schema: dict[str, Any]) -> _Part:
    bounds = [(_BOUNDS[k], schema[k]) for k in _BOUNDS if k in schema]
    if not bounds:
        return None
    if any(type(b) not in _NUMBER for _, b in bounds):
        return False
    return lambda v: type(v) not in _NUMBER or all(within(v, b) for within, b in bounds)


def _size_check(schema: dict[str, Any]) -> _Part:
    checks = []
    for low, high, of in (("minLength", "maxLength", str), ("minItems", "maxItems", list)):
        if low in schema or high in schema:
            lo, hi = schema.get(low, 0), schema.get(high)
            if type(lo) is not int or (hi is not None and type(hi) is not int):
                return False
            checks.append((of, lo, hi))
    if not checks:
        return None
    return lambda v: all(
        type(v) is not t or (a <= len(v) and (b is None or len(v) <= b)) for t, a, b in checks
    )


def _items_check(schema: dict[str, Any]) -> _Part:
    if "items" not in schema:
        return None
    item = _compile(schema["items"])
    if item is None:
        return False
    return lambda v: type(v) is not list or all(item(x) for x in v)


def _object_check(schema: dict[str, Any]) -> _Part:
    if not any(k in schema for k in ("properties", "required", "additionalProperties")):
        return None
    props = schema.get("properties", {})
    required = schema.get("required", [])
    extra = schema.get("additionalProperties", True)
    if not isinstance(props, dict) or not isinstance(required, list):
        return False
    subs: dict[str, Quick] = {}
    for name, sub in props.items():
        made = _compile(sub)
        if made is None:
            return False
        subs[name] = made
    other = None if extra is False else _compile(extra)
    if other is None and extra is not False:
        return False
    needed = tuple(required)

    def fits(v: Any) -> bool:
        if type(v) is not dict:
            return True  # not an object: only "type" decides
        for name in needed:
            if name not in v:
                return False
        for key, value in v.items():
            sub = subs.get(key)
            if sub is None:
                if other is None or not other(value):
                    return False
            elif not sub(value):
                return False
        return True

    return fits
