"""``{{field}}`` placeholders: their one grammar, and filling them from a call's arguments.

Executors parse their templates into a structure FIRST and only then fill each leaf, so a value can
never change the structure it lands in (a second argv element, a JSON key, a URL path segment).

A field the caller left out (or sent as null where text is needed) that ``input_schema`` declares and
does not require is *optional*: a leaf that is exactly that placeholder drops out of its container (the
whole template: no body), and inside longer text it reads as ``""``; an explicit ``null`` inside a
structure stays ``null``. A command's argv is the exception (dropping an argument would shift the
others). Any other missing field is ``invalid_args: ... no value for placeholder {{unit}}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import yaml

from .errors import InvalidArgs, InvalidSpec

# The grammar: group 1 is the field name, a dotted path into nested arguments.
PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_.\-]*)\s*\}\}")
# A field that is not there; as a filled leaf, one its container drops (an optional field left out).
OMIT: Any = object()
# A plain YAML scalar that cannot occur in real text and that no YAML resolver reads as non-string.
_MASK = "__hermes_placeholder_{}_7f3a__"
_MASKED = re.compile(r"__hermes_placeholder_(\d+)_7f3a__")


def names(text: str) -> list[str]:
    """Names of the placeholders in ``text``, in order."""
    return PLACEHOLDER.findall(text)


def has(text: Any) -> bool:
    return isinstance(text, str) and PLACEHOLDER.search(text) is not None


def sole(text: str) -> str | None:
    """The field name when ``text`` is exactly one placeholder (spaces around allowed), else None."""
    m = PLACEHOLDER.fullmatch(text.strip())
    return m.group(1) if m else None


def lookup(args: Mapping[str, Any], name: str) -> Any:
    """``args[name]``, or a dotted path into nested mappings (``opts.unit``); ``OMIT`` if absent."""
    if name in args:
        return args[name]
    value: Any = args
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return OMIT
        value = value[part]
    return value


def render(value: Any) -> str:
    """How an argument value reads inside a string: JSON for containers, ``str`` otherwise."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return str(value)


def optional(schema: Any, name: str) -> bool:
    """True when ``input_schema`` declares field ``name`` (dotted: each level) and does not require it."""
    if not isinstance(schema, dict):
        return False
    props = schema.get("properties")
    if isinstance(props, dict) and name in props:
        return name not in (schema.get("required") or ())
    node: Any = schema
    skippable = False
    for part in name.split("."):
        props = node.get("properties") if isinstance(node, dict) else None
        if not isinstance(props, dict) or part not in props:
            return False
        skippable = skippable or part not in (node.get("required") or ())
        node = props[part]
    return skippable


def declared(schema: Mapping[str, Any], name: str) -> bool:
    """True when ``name`` (maybe dotted) is declared, or names a level that declares nothing."""
    props = schema.get("properties")
    if isinstance(props, dict) and name in props:
        return True
    node: Any = schema
    for part in name.split("."):
        props = node.get("properties") if isinstance(node, dict) else None
        if not isinstance(props, dict) or not props:
            return True  # nothing declared at this level: nothing to judge against
        if part not in props:
            return False
        node = props[part]
    return True


def check_declared(where: str, data: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    """Registration: with declared ``properties``, each ``{{name}}`` in the spec's ``keys`` must name one."""
    schema = data.get("input_schema")
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or not isinstance(props, dict) or not props or schema.get("patternProperties"):
        return
    for key in keys:
        for path, text in _strings(data.get(key), key):
            for name in names(text):
                if not declared(schema, name):
                    raise InvalidSpec.at(
                        where,
                        path,
                        f"placeholder {{{{{name}}}}} names no property of input_schema "
                        f"(declared: {', '.join(sorted(map(str, props)))})",
                    )


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")


def value_of(
    args: dict[str, Any], name: str, where: str, allow_none: bool = False, schema: Any = None
) -> Any:
    """The argument a placeholder names; ``OMIT`` for a missing optional field (with ``schema``);
    any other missing one is the caller's mistake (InvalidArgs)."""
    value = lookup(args, name)
    if value is OMIT or (value is None and not allow_none):
        if schema is not None and optional(schema, name):
            return OMIT
        raise InvalidArgs(
            f"{where}: no value for placeholder {{{{{name}}}}}", field=name, violations=[f"$.{name}: missing"]
        )
    return value


def fill(
    text: str,
    args: dict[str, Any],
    where: str,
    encode: Callable[[str], str] | None = None,
    schema: Any = None,
) -> str:
    """Replace every placeholder in one string; ``encode`` post-processes each value (URL quoting). With
    ``schema``, a missing optional field reads as ``""``."""

    def sub(m: re.Match[str]) -> str:
        value = value_of(args, m.group(1), where, schema=schema)
        if value is OMIT:
            return ""
        out = render(value)
        return encode(out) if encode else out

    return PLACEHOLDER.sub(sub, text)


def fill_structure(template: Any, args: dict[str, Any], where: str, schema: Any = None) -> Any:
    """Fill every string leaf of an already parsed structure (keys are never templated); a leaf that is
    exactly one placeholder becomes the typed value, and drops out (``OMIT``) for a missing optional field."""
    if isinstance(template, str):
        name = sole(template)
        if name is None:
            return fill(template, args, where, schema=schema)
        return value_of(args, name, where, allow_none=True, schema=schema)  # (null stays null)
    if isinstance(template, dict):
        filled = ((k, fill_structure(v, args, where, schema)) for k, v in template.items())
        return {k: f for k, f in filled if f is not OMIT}
    if isinstance(template, list):
        return [f for f in (fill_structure(v, args, where, schema) for v in template) if f is not OMIT]
    return template


def masked_load(text: str, load: Callable[[str], Any]) -> Any:
    """``load`` (a YAML loader) on ``text`` with its placeholders kept as text wherever they stand
    (unmasked, ``{{city}}`` reads as a flow mapping used as a key)."""
    if "{{" not in text:
        return load(text)
    found: list[str] = []

    def mask(m: re.Match[str]) -> str:
        found.append(m.group(0))
        return _MASK.format(len(found) - 1)

    return _unmask(load(PLACEHOLDER.sub(mask, text)), found, {})


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that keeps ``{{field}}`` placeholders as text (the seed writes
    ``body_template: {query: {{city}}}`` unquoted); raises ``yaml.YAMLError``."""
    return masked_load(text, yaml.safe_load)


def _unmask(value: Any, found: list[str], done: dict[int, Any]) -> Any:
    # ``done``: containers already unmasked, by identity: a node repeated through YAML aliases is copied
    # once (not exponentially often), and the copy keeps the parse's sharing.
    if isinstance(value, str):
        return _MASKED.sub(lambda m: found[int(m.group(1))], value)
    if not isinstance(value, dict | list):
        return value
    key = id(value)
    if key in done:
        return done[key]
    if isinstance(value, dict):
        out: Any = {}
        done[key] = out
        for k, v in value.items():
            out[_unmask(k, found, done)] = _unmask(v, found, done)
    else:
        out = []
        done[key] = out
        out.extend(_unmask(v, found, done) for v in value)
    return out
