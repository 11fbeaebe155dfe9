"""Tool execution middleware (the contract's fourth example): wrap the tool, keep its result.

Metrics, logging or external routing can happen around ``next_call``; here it counts calls per
tool (``CALLS``), which is also what the tests read.
"""

import collections
import threading

CALLS = collections.Counter()
_lock = threading.Lock()


def register(ctx):
    ctx.register_middleware("tool_execution", annotate_tool_execution)


def annotate_tool_execution(**kwargs):
    result = kwargs["next_call"](kwargs["args"])
    with _lock:
        CALLS[kwargs.get("tool_name", "")] += 1
    return result
