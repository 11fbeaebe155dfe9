"""A quick acceptance test for the common JSON Schemas of tool arguments.

jsonschema walks a schema through generic keyword dispatch: ~40 µs a call on a small machine for a
one-property object, on every call. Tool schemas are mostly plain objects of typed properties, so those
are compiled into a check that can only say "certainly valid" (nothing more is done) or "not sure" (the
full Draft 2020-12 validator runs and reports every violation). A schema with any keyword outside the
set below gets no quick check. Where Python is looser than JSON Schema (``True == 1``, ``1 == 1.0``),
the check says "not sure". ``workers.args`` keeps the full validator next to it. With
``workers.shortcuts_off: [quickcheck]`` no schema gets one (bench/shortcuts.py measures both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from broker.shortcuts import on

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
_SCALARS = (str, int, float, bool, type(None))


def quick_check(schema: Any) -> Quick | None:
    """A check that returns True only for instances ``schema`` accepts (None: no quick check for it).

    Only plain JSON data is judged (dict with str keys, list, str, int, float, bool, None — what msgpack
    and json decode to); anything else — a Decimal, an IntEnum, an OrderedDict, a str subclass — is "not
    sure", since jsonschema applies its keywords by ``isinstance`` and the parts below by exact type.
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
    bounds = [
        (k, schema[k]) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema
    ]
    if not bounds:
        return None
    if any(type(b) not in _NUMBER for _, b in bounds):
        return False
    return lambda v: type(v) not in _NUMBER or all(_within(k, v, b) for k, b in bounds)


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


def _within(keyword: str, v: Any, bound: Any) -> bool:
    if keyword == "minimum":
        return bool(v >= bound)
    if keyword == "maximum":
        return bool(v <= bound)
    if keyword == "exclusiveMinimum":
        return bool(v > bound)
    return bool(v < bound)


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
