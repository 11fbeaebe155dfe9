"""A result is stored once: a small one in the ``done`` event (history and caller), a large one in the
record (the event says ``result_in_record``); every reader — handle, record, events — still gets it."""

from __future__ import annotations

from typing import Any

import pytest

from broker import events, keys

pytestmark = pytest.mark.e2e


def test_a_small_result_lives_only_in_the_done_event_and_a_large_one_only_in_the_record(
    home: Any, gateway: Any, workers: Any, conn: Any
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    workers(1)
    small = gateway.call_tool("echo", {"city": "北京"})
    big_text = "x" * (100 * 1024)  # over the 64 KiB a done event carries
    large = gateway.call_tool("echo", {"text": big_text})
    assert small.result(timeout=20) == {"city": "北京"}
    assert large.result(timeout=20) == {"text": big_text}

    assert conn.hget(keys.job(small.call_id), keys.F_RESULT) is None  # not in the record ...
    done = events.history(conn, small.call_id)[-1]
    assert done.state == "done" and done.detail["result"] == {"city": "北京"}  # ... only in the event
    assert gateway.calls.record(small.call_id)["result"] == {"city": "北京"}  # and the record reads it there

    assert conn.hget(keys.job(large.call_id), keys.F_RESULT) is not None
    done = events.history(conn, large.call_id)[-1]
    assert "result" not in done.detail and done.detail["result_in_record"] is True
    assert gateway.calls.record(large.call_id)["result"] == {"text": big_text}

    # A fresh handle of each (another client, the CLI's `events`, a late reader) gets the same results.
    assert gateway.handle(small.call_id).result(timeout=5) == {"city": "北京"}
    assert gateway.handle(large.call_id).result(timeout=5) == {"text": big_text}


def test_a_result_past_the_cap_fails_the_call_whatever_its_executor(
    home: Any, gateway: Any, workers: Any, conn: Any
) -> None:
    """DESIGN.md's formatting step caps a result: a python tool's too (the http, command, grpc and mcp
    executors cap what they read themselves). 1 MiB by default; the spec's max_output says otherwise."""
    from broker.errors import CallFailed

    home.echo_tool()
    home.echo_tool("roomy", max_output=4 * 1024 * 1024)
    gateway.sync_tools()
    workers(1)
    huge = "x" * (2 * 1024 * 1024)
    with pytest.raises(CallFailed) as info:
        gateway.call_tool("echo", {"text": huge}).result(timeout=20)
    assert info.value.type == "output_too_large" and "passes the cap of 1048576" in info.value.message
    roomy = gateway.call_tool("roomy", {"text": huge})
    assert roomy.result(timeout=20) == {"text": huge}
