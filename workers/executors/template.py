"""``{{field}}`` placeholders: filling one string at a time from the call's arguments.

Executors split or parse their templates into a structure FIRST and only then fill each leaf, so a
value can never change the structure it lands in (a second argv element, a JSON key, a URL path segment).

A field the caller left out (or sent as null where text is needed):

- if ``input_schema`` declares it (``properties``, followed for a dotted ``{{opts.unit}}``) and does
  not require it, it is *optional*: a leaf that is exactly that one placeholder drops out of its
  container (a ``body_template`` mapping value or list item, a header, an ``endpoint`` query
  parameter ``k={{f}}``, an ``env_set`` entry); inside longer text it reads as ``""``. A
  ``body_template`` that is nothing but that placeholder sends no body. An explicit ``null`` inside a
  ``body_template`` stays ``null``.
- the ``command`` executor's argv is the exception: a missing value there stays ``invalid_args``
  even for an optional field, because dropping an argument would shift the positions of the ones
  after it and an empty one is rarely what a program expects;
- otherwise (a required field, or one the schema does not declare) it is the caller's mistake:
  ``invalid_args: ... no value for placeholder {{unit}}``.

Registration (``broker/specstatic.py``) refuses a placeholder naming no declared property when the
schema declares any, so "not declared" only happens with schemas that declare no properties at all.
``${VAR}`` references are filled from the worker's environment before any of this, never in argument
values (``specenv.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import yaml

from broker.errors import InvalidArgs, InvalidSpec
from broker.specstatic import PLACEHOLDER
from workers.args import load_yaml_text

_MISSING = object()
# What a leaf that is exactly one placeholder of a missing optional field fills to: its container drops it.
OMIT: Any = _MISSING


def placeholders(text: str) -> list[str]:
    """Names of the placeholders in ``text``, in order."""
    return PLACEHOLDER.findall(text)


def has_placeholder(text: Any) -> bool:
    return isinstance(text, str) and PLACEHOLDER.search(text) is not None


def lookup(args: dict[str, Any], name: str) -> Any:
    """``args[name]``, or a dotted path into nested mappings (``opts.unit``); ``_MISSING`` if absent."""
    if name in args:
        return args[name]
    value: Any = args
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
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


def value_of(
    args: dict[str, Any], name: str, where: str, allow_none: bool = False, schema: Any = None
) -> Any:
    """The argument a placeholder names; ``OMIT`` for a missing optional field (with ``schema``);
    any other missing one is the caller's mistake (InvalidArgs)."""
    value = lookup(args, name)
    if value is _MISSING or (value is None and not allow_none):
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
    """Replace every placeholder in one string; ``encode`` post-processes each value (URL quoting).

    With ``schema``, a missing optional field reads as ``""``."""

    def sub(m: re.Match[str]) -> str:
        value = value_of(args, m.group(1), where, schema=schema)
        if value is OMIT:
            return ""
        out = render(value)
        return encode(out) if encode else out

    return PLACEHOLDER.sub(sub, text)


def sole_placeholder(text: str) -> str | None:
    """The field name when ``text`` is exactly one placeholder (spaces around allowed), else None."""
    m = PLACEHOLDER.fullmatch(text.strip())
    return m.group(1) if m else None


def fill_typed(text: str, args: dict[str, Any], where: str, schema: Any = None) -> Any:
    """A string that is exactly one placeholder becomes the typed value (``OMIT`` for a missing optional
    field, with ``schema``); otherwise text is filled."""
    name = sole_placeholder(text)
    if name is not None:
        # Inside a structure an explicit null stays null; only inside text would it read as "None".
        return value_of(args, name, where, allow_none=True, schema=schema)
    return fill(text, args, where, schema=schema)


def fill_structure(template: Any, args: dict[str, Any], where: str, schema: Any = None) -> Any:
    """Fill every string leaf of an already parsed structure; keys are never templated.

    With ``schema``, a leaf that is exactly one placeholder of a missing optional field drops out of
    its mapping or list (the whole template: ``OMIT``)."""
    if isinstance(template, str):
        return fill_typed(template, args, where, schema)
    if isinstance(template, dict):
        out = {}
        for k, v in template.items():
            filled = fill_structure(v, args, where, schema)
            if filled is not OMIT:
                out[k] = filled
        return out
    if isinstance(template, list):
        return [f for f in (fill_structure(v, args, where, schema) for v in template) if f is not OMIT]
    return template


_SENTINEL = "__hgw_ph_{}_c0ffee__"
_SENTINEL_RE = re.compile(r"__hgw_ph_(\d+)_c0ffee__")


def parse_template(text: str, where: str) -> Any:
    """Parse a YAML-flow/JSON template such as ``{query: {{city}}}`` into a structure, placeholders kept.

    Placeholders are masked before parsing (so ``{{city}}`` is not read as a nested mapping) and put
    back as leaf strings afterwards; :func:`fill_structure` then fills the typed values in.
    """
    found: list[str] = []

    def mask(m: re.Match[str]) -> str:
        found.append(m.group(0))
        return _SENTINEL.format(len(found) - 1)

    try:
        parsed = load_yaml_text(PLACEHOLDER.sub(mask, text))
    except yaml.YAMLError as e:
        raise InvalidSpec(f"{where}: template is not valid YAML/JSON: {e}") from e

    def unmask(value: Any) -> Any:
        if isinstance(value, str):
            return _SENTINEL_RE.sub(lambda m: found[int(m.group(1))], value)
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if isinstance(k, str) and _SENTINEL_RE.search(k):
                    raise InvalidSpec(f"{where}: template keys may not contain placeholders")
                out[k] = unmask(v)
            return out
        if isinstance(value, list):
            return [unmask(v) for v in value]
        return value

    return unmask(parsed)
