"""YAML that may hold ``{{field}}`` placeholders where YAML would read a flow mapping.

The seed writes ``body_template: {query: {{city}}, opts: {unit: {{unit}}}}`` unquoted; plain
``yaml.safe_load`` reads ``{{city}}`` as a mapping used as a key and fails. Placeholders are masked
before parsing and put back as the same text afterwards, so they survive as strings wherever they stand.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

PLACEHOLDER = re.compile(r"\{\{\s*[A-Za-z_][A-Za-z0-9_.\-]*\s*\}\}")

# A plain YAML scalar that cannot occur in real text and that no YAML resolver reads as non-string.
_MASK = "__hermes_placeholder_{}_7f3a__"
_MASKED = re.compile(r"__hermes_placeholder_(\d+)_7f3a__")


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that keeps ``{{field}}`` placeholders as text; raises ``yaml.YAMLError``."""
    if "{{" not in text:
        return yaml.safe_load(text)
    found: list[str] = []

    def mask(m: re.Match[str]) -> str:
        found.append(m.group(0))
        return _MASK.format(len(found) - 1)

    return _unmask(yaml.safe_load(PLACEHOLDER.sub(mask, text)), found, {})


def _unmask(value: Any, found: list[str], done: dict[int, Any]) -> Any:
    # ``done``: containers already unmasked, by identity. A YAML alias is the same object again, so a
    # node repeated through aliases is copied once (a few aliased levels would otherwise be copied
    # exponentially often), and the copy keeps the sharing the parse had.
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
