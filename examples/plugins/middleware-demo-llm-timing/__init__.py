"""LLM execution middleware (the contract's third example, unchanged): time the provider call.

It prints, as the contract's example does: in a worker the line goes to the worker's stdout (its log
file under ``make test``; stderr under ``mcp serve``, whose stdout is the protocol).
"""

import time


def register(ctx):
    ctx.register_middleware("llm_execution", time_llm_execution)


def time_llm_execution(**kwargs):
    started = time.monotonic()
    response = kwargs["next_call"](kwargs["request"])
    elapsed_ms = int((time.monotonic() - started) * 1000)
    print(f"llm_execution elapsed_ms={elapsed_ms}")
    return response
