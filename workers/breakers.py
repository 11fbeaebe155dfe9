"""Which circuit breaker guards a tool (one call's pass through it: ``workers/hooks/circuit.py``)."""

from __future__ import annotations

from typing import Any

from broker.breaker import BreakerConfig
from broker.toolspec import ToolSpec


def breaker_config(settings: Any, spec: ToolSpec) -> BreakerConfig | None:
    """The tool's ``breaker:`` over ``executors.<type>.breaker``; None when neither asks for one."""
    base = settings.executor_settings(spec.executor).get("breaker")
    base = base if isinstance(base, dict) else None
    if not spec.breaker and base is None:
        return None
    return BreakerConfig.of({**(base or {}), **(spec.breaker or {})}, f"tool:{spec.name}")
