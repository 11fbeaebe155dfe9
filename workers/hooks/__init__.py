"""Per-call concerns as hooks the runner runs, in the order of ``HOOKS`` in ``workers/runner.py`` (the shape of
Dramatiq's middleware); ``Hook``, which each subclasses, is here.

A call passes these stages, each a pair of methods on ``Hook``; ``CallRunner`` calls a stage's ``before_*``
in table order and its ``after_*`` in reverse, the latter also when the stage raised (``error`` set) but only
for hooks whose ``before_*`` returned. A ``before_*`` that raises a gateway error ends the call with it.

- ``before_call`` / ``after_call``: the call began here / it is over here (``outcome``: its terminal state,
  or ``retrying``, ``handed_back``, ``lost``);
- ``before_flow`` / ``after_flow``: around the tool call's middleware flow (``middleware/call_order.py``: request
  middleware, the checks, the ``tool_execution`` chain, the observer hooks);
- ``before_checks`` / ``after_checks``: on the effective arguments, after request middleware (the
  contract's policy step);
- ``before_execute`` / ``after_execute``: right around the executor, inside the ``tool_execution`` chain;
- ``ending``: a terminal move is being queued; a returned function adds its writes to that move's pipeline.

An LLM call passes ``call`` and ``ending`` only: its middleware runs per provider attempt in ``workers/llm.py``.

Hooks never move the call: the runner owns its states. A hook that has something to tell the caller appends
``(event type, detail)`` to ``run.notices``; the runner publishes them after the stage. A hook lives
with its concern: ``CallMetrics`` and ``Usage`` in ``workers/metrics.py``, ``CallSpans`` in
``workers/telemetry.py``, ``Checks`` in ``workers/policy.py``, ``Failures`` beside the worker's counters
in ``workers/runner.py``; a concern with no module of its own has one here (``audit_record``,
``call_log``, ``circuit``). A new per-call concern is one ``Hook`` subclass and a line in ``HOOKS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.toolspec import ToolSpec
    from workers.runner import Running, WorkerCore

Writer = Callable[[Any], None]  # more writes in the terminal move's pipeline


class Hook:
    """One per-call concern; override the stages it takes part in (the others are skipped)."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def before_call(self, run: Running) -> None: ...

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None: ...

    def before_flow(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_flow(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def before_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_checks(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def before_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_execute(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        return None


def overrides(hook: Hook, name: str) -> bool:
    """Whether ``hook`` does something at ``name`` (the runner skips the no-op base methods)."""
    return getattr(type(hook), name) is not getattr(Hook, name)
