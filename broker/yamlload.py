"""YAML that may hold ``{{field}}`` placeholders where YAML would read a flow mapping.

The seed writes ``body_template: {query: {{city}}, opts: {unit: {{unit}}}}`` unquoted; plain
``yaml.safe_load`` reads ``{{city}}`` as a mapping used as a key and fails. Placeholders are masked
before parsing and put back as the same text afterwards (``placeholders.masked_load``), so they survive
as strings wherever they stand.
"""

from __future__ import annotations

from typing import Any

import yaml

from .placeholders import masked_load


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that keeps ``{{field}}`` placeholders as text; raises ``yaml.YAMLError``."""
    return masked_load(text, yaml.safe_load)
