"""LLM execution middleware (the contract's third example): time the provider call.

The contract's example prints; a worker's stdout is not a log, so this logs through the standard
``logging`` module instead (the plugin must also run inside the Hermes agent, so no structlog).
"""

import logging
import time

log = logging.getLogger("hermes_plugins.middleware_demo_llm_timing")


def register(ctx):
    ctx.register_middleware("llm_execution", time_llm_execution)


def time_llm_execution(**kwargs):
    started = time.monotonic()
    response = kwargs["next_call"](kwargs["request"])
    elapsed_ms = int((time.monotonic() - started) * 1000)
    log.info("llm_execution elapsed_ms=%d model=%s", elapsed_ms, kwargs.get("model", ""))
    return response
