"""Malformed payloads and unknown tools fail with typed errors while the worker keeps serving."""

from __future__ import annotations

import time
from typing import Any

import pytest

from broker import keys
from broker.calls import Calls
from broker.codec import pack
from broker.envelope import Envelope
from broker.errors import CallFailed
from broker.otel import ensure_traceparent
from tests.e2e.util import all_terminal, current, error_type, states

pytestmark = pytest.mark.e2e


def write_raw_call(conn: Any, call_id: str, data: bytes | None, channel: str) -> None:
    """A call written by hand, the way a buggy or hostile client could: job hash + queue entry."""
    fields: dict[str, Any] = {
        keys.F_STATE: "pending",
        keys.F_ATTEMPT: 1,
        keys.F_MAX_ATTEMPTS: 3,
        keys.F_SEQ: 0,
        keys.F_CHANNEL: channel,
        keys.F_CKEY: "tool:echo",
        keys.F_KIND: "tool",
        keys.F_TOOL: "echo",
        "status": "queued",
        "origin": "tools",
    }
    if data is not None:
        fields["data"] = data
    conn.hset(keys.job(call_id), mapping=fields)
    conn.rpush(keys.queue("tools"), call_id)


def good_env(**kw: Any) -> dict[str, Any]:
    env = Envelope(call_id="x", kind="tool", tool="echo", args={}, traceparent=ensure_traceparent(None))
    return {**env.to_dict(), **kw}


MALFORMED = {
    "garbage": b"\xc1\xc1\xc1 not msgpack at all",
    "truncated": pack(["workers.entry.run_call", None, [good_env()], {}])[:-7],
    "not-a-job": pack({"func": "os.system", "args": ["rm -rf /"]}),
    "pickle": b"\x80\x04\x95\x1b\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.",
    "future-version": pack(["workers.entry.run_call", None, [good_env(version=99)], {}]),
    "wrong-types": pack(["workers.entry.run_call", None, [good_env(tool_version="latest")], {}]),
    # (a context value that is not text crashed the call's end after the tool ran: run thrice, worker_lost)
    "context-mapping": pack(
        ["workers.entry.run_call", None, [good_env(call_id="bad-context-mapping", context={"principal": {"a": 1}})], {}]
    ),
    "context-bool": pack(
        ["workers.entry.run_call", None, [good_env(call_id="bad-context-bool", context={"principal": True})], {}]
    ),
    "no-data": None,
}


def test_malformed_payloads_and_unknown_tools_fail_typed_and_the_worker_keeps_serving(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    home.echo_tool()
    home.echo_tool("temp")
    gateway.sync_tools()
    # Submitted while the tool exists, then the tool is removed before any worker picks the call up.
    doomed = gateway.call_tool("temp", {"a": 1})
    assert gateway.directory.remove("temp")
    bad_ids = []
    for name, data in MALFORMED.items():
        write_raw_call(conn, f"bad-{name}", data, gateway.channel)
        bad_ids.append(f"bad-{name}")

    [w] = workers(1, concurrency=4)
    ids = [*bad_ids, doomed.call_id]
    wait_until(lambda: all_terminal(conn, ids), 10, message="the bad calls to end")

    for cid in bad_ids:
        assert current(conn, [cid])[cid] == "failed", cid
        assert error_type(conn, cid) == "bad_payload", cid
        assert states(conn, cid) == ["failed"], cid
    assert states(conn, doomed.call_id) == ["failed"]  # (an ended call keeps its terminal event)
    assert error_type(conn, doomed.call_id) == "unknown_tool"
    with pytest.raises(CallFailed) as info:
        doomed.result(timeout=5)
    assert info.value.type == "unknown_tool"
    assert [e.state for e in doomed.events(timeout=1)] == ["pending", "routing", "failed"]  # as its caller heard

    # Still serving: a normal call afterwards succeeds, on the same process.
    assert gateway.call_tool("echo", {"after": True}).result(timeout=10) == {"after": True}
    assert w.alive
    wait_until(lambda: conn.hget(keys.worker(w.name), "processed") == b"%d" % (len(ids) + 1), 5)
    assert int(conn.hget(keys.worker(w.name), "failed")) == len(ids)
    assert "Traceback" not in w.log()


def test_a_tool_removed_after_a_worker_cached_it_is_unknown(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    home.echo_tool("temp")
    gateway.sync_tools()
    [w] = workers(1, concurrency=2)
    assert gateway.call_tool("temp", {"n": 1}).result(timeout=10) == {"n": 1}  # the worker knows it now
    version = gateway.tool("temp").version
    beat, t0 = keys.worker(w.name), time.time()
    # Its heartbeat reports the directory notices it has heard: one from now on, then one more after.
    wait_until(lambda: float(conn.hget(beat, "heartbeat") or 0) > t0, 5)
    heard = int(conn.hget(beat, "tool_notices") or 0)
    assert gateway.directory.remove("temp")
    wait_until(lambda: int(conn.hget(beat, "tool_notices") or 0) > heard, 5)  # the worker dropped it
    # A client that still believes in the tool submits straight to Redis.
    env = Envelope(
        call_id="stale",
        kind="tool",
        tool="temp",
        args={"n": 2},
        tool_version=version,
        traceparent=ensure_traceparent(None),
        channel=gateway.channel,
    )
    Calls(conn).submit(env, ckey="tool:temp", queue_size=-1, max_attempts=1, timeout=5)
    handle = gateway.handle("stale")
    with pytest.raises(CallFailed) as info:
        handle.result(timeout=10)
    assert info.value.type == "unknown_tool"


def test_numbers_past_the_wire_end_the_call_typed_once_and_other_calls_are_untouched(
    gateway: Any, home: Any, workers: Any, tmp_path: Any
) -> None:
    """A string the schema turns into a number too big for msgpack stayed a number: the call's audit
    record could not be encoded, its end (and the other writes of that round trip) were never written, and
    the call ran again every lease. Now it fails invalid_args once, and the calls beside it end done."""
    log = tmp_path / "runs"
    home.tool(
        "counted", function="tests.e2e.flowtools:counted", timeout=10,
        input_schema={"type": "object", "properties": {"seconds": {"type": "number"}, "log": {"type": "string"},
                                                       "n": {"type": "integer"}}},
    )  # fmt: skip
    home.echo_tool()
    gateway.sync_tools()
    workers(1, concurrency=8)
    others = gateway.map("echo", [{"i": i} for i in range(40)])
    bad = gateway.call_tool("counted", {"seconds": 0, "log": str(log), "n": "1" + "0" * 30})
    with pytest.raises(CallFailed) as info:
        bad.result(20)
    assert info.value.type == "invalid_args"
    assert [h.result(20) for h in others.accepted] == [{"i": i} for i in range(40)]
    assert not log.exists()  # it never ran (the schema refused it before the tool)
    huge = gateway.call_tool("counted", {"seconds": 0, "log": str(log), "n": "9" * 5000})
    with pytest.raises(CallFailed) as info:
        huge.result(20)
    assert info.value.type == "invalid_args"  # (not internal_error: more digits than Python converts)


def test_a_payload_naming_another_calls_id_fails_alone_and_leaves_that_call_untouched(
    gateway: Any, home: Any, workers: Any, conn: Any, wait_until: Any
) -> None:
    """A job whose envelope names another call's id ran as that call: it ended a waiting call of another
    principal with its own result, and was itself never ended (the tool ran again every lease)."""
    home.echo_tool()
    home.echo_tool("theirs", queue="q2")  # (no worker on q2 yet: the call waits)
    gateway.sync_tools()
    victim = gateway.call_tool("theirs", {"mine": 1}, principal="bob")
    env = good_env(call_id=victim.call_id, args={"forged": 1}, queue="q2", context={"principal": "mallory"})
    write_raw_call(conn, "forged", pack(["workers.entry.run_call", None, [env], {}]), gateway.channel)
    [w] = workers(1, concurrency=2)
    wait_until(lambda: all_terminal(conn, ["forged"]), 10, message="the forged call to end")
    assert error_type(conn, "forged") == "bad_payload"
    assert states(conn, "forged") == ["failed"]
    assert current(conn, [victim.call_id])[victim.call_id] == "pending"  # untouched, still waiting
    workers(1, queues="q2")
    assert victim.result(timeout=10) == {"mine": 1}
    assert w.alive and "Traceback" not in w.log()
