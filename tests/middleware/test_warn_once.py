"""Warn-once under concurrency, and thread safety of the shared runtime."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from middleware import LLMCallFlow, MiddlewareRegistry, ToolCallFlow
from middleware.reporter import FailureReporter
from tests.middleware.helpers import debugs_of, warnings_of

THREADS = 50


def test_fail_open_under_concurrency_warns_exactly_once(registry: MiddlewareRegistry, logs: list) -> None:
    barrier = threading.Barrier(THREADS)

    def misdeclared(args: dict) -> dict:  # Hermes sends many more fields: TypeError every call
        return {"args": args}

    def tagging(**kw: Any) -> Any:
        return kw["next_call"]({**kw["args"], "tagged": True})

    registry.register_middleware("tool_request", misdeclared)
    registry.register_middleware("tool_execution", tagging)
    flow = ToolCallFlow(registry)

    def call(i: int) -> Any:
        barrier.wait()  # all calls in flight together
        return flow.run("t", {"i": i}, execute=lambda a: a, context={"tool_call_id": str(i)})

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(call, range(THREADS)))
    assert results == [{"i": i, "tagged": True} for i in range(THREADS)]
    assert len(warnings_of(logs)) == 1
    assert len([e for e in debugs_of(logs) if e.get("repeated")]) == THREADS - 1


def test_concurrent_llm_calls_keep_their_own_requests(registry: MiddlewareRegistry) -> None:
    barrier = threading.Barrier(THREADS)
    registry.register_middleware(
        "llm_request", lambda **kw: {"request": {**kw["request"], "seen_by": kw["turn_id"]}}
    )
    registry.register_middleware("llm_execution", lambda **kw: kw["next_call"](kw["request"]))
    flow = LLMCallFlow(registry)

    def call(i: int) -> Any:
        barrier.wait()
        return flow.run({"n": i}, call_provider=lambda req: req, context={"turn_id": f"turn-{i}"})

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(call, range(THREADS)))
    assert results == [{"n": i, "seen_by": f"turn-{i}"} for i in range(THREADS)]


def test_different_failures_each_warn_once(logs: list) -> None:
    reporter = FailureReporter()

    def cb() -> None: ...

    assert reporter.report("tool_request", cb, ValueError("a"), ["args"]) is True
    assert reporter.report("tool_request", cb, ValueError("a"), ["args"]) is False
    assert reporter.report("tool_request", cb, ValueError("b"), ["args"]) is True
    assert reporter.report("llm_request", cb, ValueError("a"), ["request"]) is True
    reporter.reset()
    assert reporter.report("tool_request", cb, ValueError("a"), ["args"]) is True
    assert len(warnings_of(logs)) == 4
