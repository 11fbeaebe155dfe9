"""``{{field}}`` placeholders: filling one string at a time from the call's arguments.

Executors split or parse their templates into a structure FIRST and only then fill each leaf, so a
value can never change the structure it lands in (a second argv element, a JSON key, a URL path segment).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import yaml

from broker.errors import InvalidArgs, InvalidSpec
from workers.args import load_yaml_text

PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_.\-]*)\s*\}\}")

_MISSING = object()


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


def value_of(args: dict[str, Any], name: str, where: str, allow_none: bool = False) -> Any:
    """The argument a placeholder names; a missing one is the caller's mistake (InvalidArgs)."""
    value = lookup(args, name)
    if value is _MISSING or (value is None and not allow_none):
        raise InvalidArgs(
            f"{where}: no value for placeholder {{{{{name}}}}}", field=name, violations=[f"$.{name}: missing"]
        )
    return value


def fill(text: str, args: dict[str, Any], where: str, encode: Callable[[str], str] | None = None) -> str:
    """Replace every placeholder in one string; ``encode`` post-processes each value (URL quoting)."""

    def sub(m: re.Match[str]) -> str:
        out = render(value_of(args, m.group(1), where))
        return encode(out) if encode else out

    return PLACEHOLDER.sub(sub, text)


def fill_typed(text: str, args: dict[str, Any], where: str) -> Any:
    """A string that is exactly one placeholder becomes the typed value; otherwise text is filled."""
    m = PLACEHOLDER.fullmatch(text.strip())
    if m:
        # Inside a structure an explicit null stays null; only inside text would it read as "None".
        return value_of(args, m.group(1), where, allow_none=True)
    return fill(text, args, where)


def fill_structure(template: Any, args: dict[str, Any], where: str) -> Any:
    """Fill every string leaf of an already parsed structure; keys are never templated."""
    if isinstance(template, str):
        return fill_typed(template, args, where)
    if isinstance(template, dict):
        return {k: fill_structure(v, args, where) for k, v in template.items()}
    if isinstance(template, list):
        return [fill_structure(v, args, where) for v in template]
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
