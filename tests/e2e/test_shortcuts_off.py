"""A worker process with every shortcut off (``workers.shortcuts_off``) runs calls on the stock twins:
results, argument checks, log lines and a graceful stop all as with them on."""

from __future__ import annotations

from typing import Any

import pytest

from broker.errors import InvalidArgs

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def test_a_worker_with_every_shortcut_off_runs_checks_and_logs_calls(gateway: Any, home: Any, workers: Any) -> None:
    home.config({"workers": {"shortcuts_off": ["threads", "quickcheck", "frozen", "redaction"]}})
    home.echo_tool(input_schema=SCHEMA)
    gateway.sync_tools()
    (worker,) = workers(1, concurrency=4, queues="tools")
    handles = [gateway.call_tool("echo", {"text": f"hi {i}", "password": "hunter2"}) for i in range(8)]
    assert [h.result(timeout=20)["text"] for h in handles] == [f"hi {i}" for i in range(8)]
    with pytest.raises(InvalidArgs, match="'text' is a required property"):
        gateway.call_tool("echo", {"other": 1}).result(timeout=20)
    worker.terminate()
    assert worker.wait(20) == 0
    log = worker.log()
    assert "shortcuts_off=['frozen', 'quickcheck', 'redaction', 'threads']" in log
    assert "call finished" in log and "worker stopped" in log and "hunter2" not in log
