"""Flows: several tool calls orchestrated as one — serial (a result feeds the next step's arguments by
reference), parallel (fan-out, one combined result, failures per item), conditional (``when``), and
breaker fallback (another tool, or skip, while a tool's breaker is open)::

    flow = Flow("trip").step("lookup", "geo", {"name": "{{ args.person }}"})
    flow.step("weather", "weather", {"city": "{{ steps.lookup.result.city }}"}, fallback="skip")
    result = run_flow(gw, flow, {"person": "Ada"})

A flow is also a YAML/JSON document (:meth:`Flow.load`); ``hermes-gateway flow run flow.yaml``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_gateway.flows.engine import FlowResult, FlowRunner, StepEvent, StepResult
from hermes_gateway.flows.expr import Expression, compile_template, render
from hermes_gateway.flows.model import Fallback, Flow, Step

if TYPE_CHECKING:
    from hermes_gateway.client import Gateway

__all__ = [
    "Expression", "Fallback", "Flow", "FlowResult", "FlowRunner", "Step", "StepEvent", "StepResult",
    "compile_template", "load_flow", "render", "run_flow",
]


def load_flow(source: str | Path | dict[str, Any]) -> Flow:
    """A flow from a file path or an already-parsed document."""
    return Flow.from_dict(source) if isinstance(source, dict) else Flow.load(source)


def run_flow(
    gateway: Gateway, flow: Flow | str | Path | dict[str, Any], args: dict[str, Any] | None = None, *,
    on_event: Callable[[StepEvent], None] | None = None, wait: float | None = 300.0, **context: Any,
) -> FlowResult:
    """Run a flow on ``gateway``; ``context`` (session_id, principal, ...) goes with every call."""
    f = flow if isinstance(flow, Flow) else load_flow(flow)
    return FlowRunner(gateway, on_event=on_event, wait=wait, **context).run(f, args)
