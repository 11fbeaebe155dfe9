"""Shared fixtures for executor tests."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from workers.executors import ExecContext


@pytest.fixture
def make_ctx() -> Callable[..., ExecContext]:
    """Build an ExecContext that records progress messages in ``ctx.messages``."""

    def make(timeout: float = 10.0, **kw: object) -> ExecContext:
        messages: list[str] = []
        ctx = ExecContext(
            call_id="c-test",
            tool_name="t",
            timeout=timeout,
            cancelled=threading.Event(),
            progress_sink=messages.append,
            **kw,  # type: ignore[arg-type]
        )
        ctx.messages = messages  # type: ignore[attr-defined]
        return ctx

    return make
