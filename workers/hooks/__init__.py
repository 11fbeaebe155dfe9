"""Per-call concerns as hooks the runner runs, in the order of ``HOOKS`` (the shape of Dramatiq's middleware).

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
``(event type, detail)`` to ``run.notices``; the runner publishes them after the stage. A new per-call
concern is a module here with one ``Hook`` subclass and a line in ``HOOKS``.
"""

from __future__ import annotations

from workers.hooks.audit_record import AuditRecordHook
from workers.hooks.call_log import CallLog
from workers.hooks.call_metrics import CallMetrics
from workers.hooks.call_spans import CallSpans
from workers.hooks.checks import Checks
from workers.hooks.circuit import Circuit
from workers.hooks.failures import Failures
from workers.hooks.hook import Hook, Writer, overrides
from workers.hooks.usage import Usage

# The one table: ``before_*`` run in this order, ``after_*`` in reverse. The breaker is checked before the
# executor span opens (an open circuit calls no executor); the spans wrap the checks (a ``policy`` span).
HOOKS: list[type[Hook]] = [CallMetrics, CallLog, Circuit, CallSpans, Checks, Usage, AuditRecordHook, Failures]

__all__ = ["HOOKS", "Hook", "Writer", "overrides"]
