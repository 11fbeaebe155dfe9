"""A worker's call path in-process on fakeredis: the runner, lease fencing, the reaper, control messages."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broker import events, keys
from broker.calls import CallInfo, Calls, Claimed
from broker.codec import pack, unpack
from broker.config import Settings, WorkerSettings
from broker.directory import Directory
from broker.envelope import Envelope, Options
from broker.states import State
from tests.conftest import heard, wait_until
from workers import reaper
from workers.runner import CallRunner, WorkerCore
from workers.specs import check_spec
from workers.worker import Worker, control_message

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TP = f"00-{TRACE}-{SPAN}-01"
TOOLS = [
    {"name": "echo", "executor": "python", "function": "workers.executors.builtin:echo", "timeout": 5},
    {"name": "sleep", "executor": "python", "function": "workers.executors.builtin:sleep", "timeout": 30},
]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, workers=WorkerSettings(lease=5.0, result_ttl=600))


@pytest.fixture
def core(fake: Any, settings: Settings) -> Any:
    for spec in TOOLS:
        Directory(fake).register(check_spec(spec))
    c = WorkerCore(fake, settings, "w-test")
    yield c
    c.close()


def submit(
    fake: Any, call_id: str, tool: str = "echo", max_attempts: int = 3, call_class: str | None = None, **args: Any
) -> CallInfo:
    heard(fake)  # (listening as the caller does: an ended call's history is its last event alone)
    env = Envelope(
        call_id=call_id,
        kind="tool",
        tool=tool,
        args=args,
        traceparent=TP,
        channel="hermes:ch:t",
        context={"session_id": "s"},
        options=Options(max_attempts=max_attempts, call_class=call_class),
    )
    ckey = f"tool:{tool}"
    Calls.check_submit(
        Calls(fake).submit(env, ckey=ckey, queue_size=-1, max_attempts=max_attempts, timeout=30), ckey, -1
    )
    return CallInfo.of(env, ckey)


def run_all(core: WorkerCore) -> list[Claimed]:
    claimed = core.calls.claim(["tools"], 100, core.name, core.settings.workers.lease)
    runner = CallRunner(core)
    for c in claimed:
        runner.run(c)
    assert core.outbox.flush(5)
    return claimed


def states(fake: Any, call_id: str) -> list[str]:
    return [e.state for e in heard(fake).events(call_id) if e.type == events.TRANSITION]


# -- the runner --------------------------------------------------------------------------------


def test_a_call_runs_through_every_state_to_done(fake: Any, core: WorkerCore) -> None:
    submit(fake, "c1", city="北京")
    run_all(core)
    hist = heard(fake).events("c1")
    (kept,) = events.history(fake, "c1")  # (what an ended call keeps: its terminal event, with its steps)
    assert kept.to_dict() == hist[-1].to_dict() | {"steps": kept.steps}
    assert [e.state for e in hist] == ["pending", "routing", "executing", "formatting", "done"]
    assert [e.seq for e in hist] == [1, 2, 3, 4, 5]
    assert {e.trace_id for e in hist} == {TRACE}
    assert hist[0].span_id == SPAN
    worker_spans = {e.span_id for e in hist[1:]}
    assert len(worker_spans) == 1 and SPAN not in worker_spans  # the attempt is a child span
    assert hist[1].detail == {"worker": "w-test"}
    assert hist[-1].detail["result"] == {"city": "北京"}
    rec = core.calls.record("c1")
    assert rec["state"] == "done" and rec["result"] == {"city": "北京"}
    assert fake.zscore(keys.leases("{tools}"), "c1") is None
    assert fake.hget(keys.job("c1"), "status") == b"finished"
    assert core.processed == 1 and core.failed == 0


def test_a_batch_calls_writes_go_through_an_outbox_of_their_own(fake: Any, core: WorkerCore, monkeypatch: Any) -> None:
    """An agent's call never waits behind a batch's round trip: a batch call's moves are sent by a second
    outbox thread (started with the first batch call), an interactive call's by the first; both end done."""
    sent_by: dict[str, set[str]] = {}
    move = core.calls.move

    def recording(info: CallInfo, *args: Any, **kwargs: Any) -> Any:
        sent_by.setdefault(info.call_id, set()).add(threading.current_thread().name)
        return move(info, *args, **kwargs)

    monkeypatch.setattr(core.calls, "move", recording)
    submit(fake, "agent", city="a")
    submit(fake, "item", call_class="batch", city="b")
    claimed = core.calls.claim(["tools"], 2, core.name, core.settings.workers.lease)
    runner = CallRunner(core)
    for c in claimed:
        runner.run(c)
    core.flush(5)
    assert sent_by == {"agent": {"hermes-outbox"}, "item": {"hermes-outbox-batch"}}
    assert core.calls.record("agent")["state"] == core.calls.record("item")["state"] == "done"


def test_a_finished_call_leaves_no_cycle_for_the_garbage_collector(fake: Any, core: WorkerCore) -> None:
    # Workers collect rarely (workers.gc_threshold, 50,000): a cycle per call made each collection a
    # 20-45 ms pause of every call in the process (bench/mix.py's interactive p99).
    import gc

    from workers.runner import Running

    submit(fake, "warm")  # (the first call loads the scripts: fakeredis's NOSCRIPT tracebacks hold its frames)
    run_all(core)
    gc.collect()
    gc.disable()
    try:
        for i in range(5):
            submit(fake, f"c{i}")
        run_all(core)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, Running)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert core.processed == 6
    assert left == []


def test_an_undecodable_payload_fails_that_call_with_bad_payload(fake: Any, core: WorkerCore) -> None:
    submit(fake, "c1")
    fake.hset(keys.job("c1"), "data", b"\xc1\xc1 garbage")
    submit(fake, "c2")
    run_all(core)
    assert states(fake, "c1") == ["pending", "failed"]
    assert core.calls.record("c1")["error"]["type"] == "bad_payload"
    assert states(fake, "c2")[-1] == "done"
    failures = [unpack(x) for x in fake.lrange(keys.FAILURES, 0, -1)]
    assert [f["call_id"] for f in failures] == ["c1"]


def test_an_unknown_tool_fails_with_unknown_tool(fake: Any, core: WorkerCore) -> None:
    submit(fake, "c1")
    Directory(fake).remove("echo")
    run_all(core)
    assert states(fake, "c1") == ["pending", "routing", "failed"]
    err = core.calls.record("c1")["error"]
    assert err["type"] == "unknown_tool" and err["details"] == {"tool": "echo"}


def test_a_result_msgpack_cannot_carry_fails_the_call_not_the_worker(
    fake: Any, core: WorkerCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    submit(fake, "c1")
    monkeypatch.setattr("workers.runner.run_executor", lambda *_: object())
    run_all(core)
    assert core.calls.record("c1")["error"]["type"] == "unserializable_result"


def test_a_worker_that_lost_its_lease_cannot_move_the_call(
    fake: Any, core: WorkerCore, settings: Settings
) -> None:
    submit(fake, "c1", tool="sleep", seconds=30)
    [claimed] = core.calls.claim(["tools"], 1, core.name, settings.workers.lease)
    runner = CallRunner(core)
    thread = threading.Thread(target=runner.run, args=(claimed,))
    thread.start()
    deadline = time.monotonic() + 5
    while "executing" not in states(fake, "c1"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # The lease runs out (the worker looked dead) and a reaper gives the call a second attempt.
    fake.zadd(keys.leases("{tools}"), {"c1": time.time() - 1})
    assert reaper.reap(Calls(fake), ["tools"], lease=5, result_ttl=600) == 1
    assert states(fake, "c1")[-2:] == ["retrying", "pending"]
    # The old attempt's next write is fenced off; the runner notices, stops its tool and writes nothing.
    core.inflight()[0].ctx.progress("still here")  # (the progress sink the runner gave the tool)
    thread.join(5)
    assert not thread.is_alive()
    assert core.outbox.flush(5)
    rec = core.calls.record("c1")
    assert (rec["state"], rec["attempt"]) == ("pending", 2)
    assert states(fake, "c1") == ["pending", "routing", "executing", "retrying", "pending"]
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"c1"]


def test_a_cancel_control_message_stops_a_running_call(
    fake: Any, core: WorkerCore, settings: Settings
) -> None:
    submit(fake, "c1", tool="sleep", seconds=30)
    [claimed] = core.calls.claim(["tools"], 1, core.name, settings.workers.lease)
    thread = threading.Thread(target=CallRunner(core).run, args=(claimed,))
    thread.start()
    deadline = time.monotonic() + 5
    while "executing" not in states(fake, "c1"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert core.cancel("c1") is True  # it runs here
    thread.join(5)
    assert core.outbox.flush(5)
    assert states(fake, "c1")[-1] == "cancelled"
    assert core.calls.record("c1")["error"]["type"] == "cancelled"


def test_a_cancel_that_arrives_before_the_call_starts_still_stops_it(fake: Any, core: WorkerCore) -> None:
    submit(fake, "c1", tool="sleep", seconds=30)
    assert core.cancel("c1") is False  # not running here (yet): remembered
    run_all(core)
    assert states(fake, "c1")[-1] == "cancelled"


# -- the reaper --------------------------------------------------------------------------------


def _start(fake: Any, info: CallInfo, upto: list[State], worker: str = "dead-worker") -> None:
    Calls(fake).claim(["tools"], 1, worker, 30)
    for target in upto:
        assert Calls(fake).transition(info, target, attempt=1)[0] > 0
    fake.zadd(keys.leases("{tools}"), {info.call_id: time.time() - 1})


def test_reaper_retries_a_lost_call_while_attempts_are_left(fake: Any) -> None:
    info = submit(fake, "c1", max_attempts=3)
    _start(fake, info, [State.ROUTING, State.EXECUTING])
    assert reaper.reap(Calls(fake), ["tools"], lease=5, result_ttl=600) == 1
    hist = events.history(fake, "c1")
    assert [e.state for e in hist] == ["pending", "routing", "executing", "retrying", "pending"]
    assert hist[3].detail == {"reason": "worker_lost", "next_attempt": 2}
    assert (hist[3].attempt, hist[4].attempt) == (1, 2)
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"c1"]
    assert fake.zscore(keys.slots("{tools}", "tool:echo"), "c1") == float("inf")  # back on the queue with a slot
    assert fake.zscore(keys.leases("{tools}"), "c1") is None
    assert int(fake.hget(keys.job("c1"), keys.F_ATTEMPT)) == 2
    assert reaper.reap(Calls(fake), ["tools"], lease=5, result_ttl=600) == 0


def test_reaper_fails_a_lost_call_with_worker_lost_when_no_attempts_are_left(fake: Any) -> None:
    info = submit(fake, "c1", max_attempts=1)
    _start(fake, info, [State.ROUTING, State.EXECUTING, State.FORMATTING])
    reaper.reap(Calls(fake), ["tools"], lease=5, result_ttl=600)
    assert states(fake, "c1")[-1] == "failed"
    rec = Calls(fake).record("c1")
    assert rec["error"]["type"] == "worker_lost"
    assert events.history(fake, "c1")[-1].detail["error"]["type"] == "worker_lost"
    assert fake.llen(keys.queue("tools")) == 0
    assert fake.zscore(keys.leases("{tools}"), "c1") is None
    # counted with the calls the workers ended, and listed with their failures (status's first stop)
    assert fake.hget(keys.STATS, keys.stats_ended("tool", "echo", "failed", "worker_lost")) == b"1"
    [failure] = [unpack(x) for x in fake.lrange(keys.FAILURES, 0, -1)]
    assert failure["call_id"] == "c1" and failure["error"]["type"] == "worker_lost" and failure["worker"] == "reaper"


def test_reaper_puts_back_a_call_claimed_but_never_started_as_its_next_attempt(fake: Any) -> None:
    info = submit(fake, "c1")
    max_before = int(fake.hget(keys.job("c1"), keys.F_MAX_ATTEMPTS))
    _start(fake, info, [])
    reaper.reap(Calls(fake), ["tools"], lease=5, result_ttl=600)
    assert states(fake, "c1") == ["pending"]
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"c1"]
    # Its worker may have started it with the first move still unwritten (write-behind, or lost in a
    # failover): a second run is reported as attempt 2, and the budget grows with it.
    assert int(fake.hget(keys.job("c1"), keys.F_ATTEMPT)) == 2
    assert int(fake.hget(keys.job("c1"), keys.F_MAX_ATTEMPTS)) == max_before + 1
    assert [(c.call_id, c.attempt) for c in Calls(fake).claim(["tools"], 5, "w2", 30)] == [("c1", 2)]


def test_reaper_cancels_a_lost_call_that_was_being_cancelled(fake: Any) -> None:
    info = submit(fake, "c1")
    _start(fake, info, [State.ROUTING, State.EXECUTING])
    fake.hset(keys.job("c1"), keys.F_CANCEL, "1")
    reaper.reap(Calls(fake), ["tools"], lease=5, result_ttl=600)
    assert states(fake, "c1")[-1] == "cancelled"
    assert fake.llen(keys.queue("tools")) == 0


def test_reaper_cancels_a_call_claimed_never_started_and_being_cancelled(fake: Any) -> None:
    info = submit(fake, "c1")
    _start(fake, info, [])  # its worker took it (still "pending" in Redis), was told to cancel, died
    fake.hset(keys.job("c1"), keys.F_CANCEL, "1")
    reaper.reap(Calls(fake), ["tools"], lease=5, result_ttl=600)
    assert states(fake, "c1") == ["pending", "cancelled"]
    assert fake.llen(keys.queue("tools")) == 0 and fake.zscore(keys.leases("{tools}"), "c1") is None
    assert fake.zscore(keys.slots("{tools}", "tool:echo"), "c1") is None  # its slot went back


def test_reaper_finishes_a_retry_its_predecessor_left_half_done(fake: Any) -> None:
    info = submit(fake, "c1")
    _start(fake, info, [State.ROUTING])
    Calls(fake).transition(info, State.RETRYING, attempt=1, fields={keys.F_ATTEMPT: 2})
    fake.zadd(keys.leases("{tools}"), {"c1": time.time() - 1})
    reaper.reap(Calls(fake), ["tools"], lease=5, result_ttl=600)
    assert states(fake, "c1") == ["pending", "routing", "retrying", "pending"]
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"c1"]


def test_reaper_drops_leases_of_finished_calls(fake: Any) -> None:
    info = submit(fake, "c1")
    _start(fake, info, [State.ROUTING, State.EXECUTING, State.FORMATTING, State.DONE])
    fake.zadd(keys.leases("{tools}"), {"c1": time.time() - 1})
    reaper.reap(Calls(fake), ["tools"], lease=5, result_ttl=600)
    assert fake.zcard(keys.leases("{tools}")) == 0
    assert states(fake, "c1")[-1] == "done"


# -- control messages --------------------------------------------------------------------------


def test_control_messages_stop_and_cancel_and_ignore_the_rest(fake: Any, settings: Settings) -> None:
    w = Worker(fake, settings, ["tools"], concurrency=2, name="w-a")
    try:
        w._on_control(b"\xc1 not msgpack")
        w._on_control(pack(["op", "stop"]))
        w._on_control(control_message("stop", worker="w-b"))  # addressed to another worker
        w._on_control(control_message("reboot"))
        assert not w.stopping.is_set()
        w._on_control(control_message("cancel", call_id="c9"))
        assert w.core.is_cancelled("c9")
        w._on_control(control_message("stop", worker="w-a"))
        assert w.stopping.is_set()
    finally:
        w.core.close()
        w.pool.shutdown()
    assert unpack(control_message("stop")) == {"op": "stop"}


def test_the_held_count_follows_runs_even_when_a_newer_run_replaced_an_older_one(fake: Any, core: WorkerCore) -> None:
    from workers.runner import Running

    info = CallInfo("c1", TRACE, SPAN, "tool", "echo", None, "hermes:ch:t", "tool:echo", "tools")
    old, new = Running(info, None, 1), Running(info, None, 2)  # type: ignore[arg-type]
    core.track(old)
    core.track(new)  # the call came back to this worker while the old run was still winding down
    assert core.held("tool:echo") == 2
    core.untrack(old)
    assert core.held("tool:echo") == 1 and core.inflight() == [new]
    core.untrack(new)
    assert core.held("tool:echo") == 0 and core.inflight() == []


def test_a_call_whose_last_writes_wait_in_the_outbox_keeps_its_lease_until_they_land(
    fake: Any, settings: Settings
) -> None:
    """A cluster slot moving holds a finished call's writes in the outbox (issue 31): the call is no longer
    running here, but its lease must still be extended, or the reaper takes it and runs it again."""
    for spec in TOOLS:
        Directory(fake).register(check_spec(spec))
    w = Worker(fake, settings, ["tools"], concurrency=2, name="w-a")
    gate, busy = threading.Event(), threading.Event()

    def blocker(pipe: Any) -> None:  # the sender stays busy: the call's writes queue up behind it
        busy.set()
        gate.wait(10)
        pipe.exists(keys.WORKERS)

    try:
        submit(fake, "c1")
        [claimed] = w.core.calls.claim(["tools"], 1, w.name, w.lease)
        w.core.outbox.put(blocker)
        assert busy.wait(5)
        w.runner.run(claimed)  # ends here; done is not written yet
        assert w.core.inflight() == [] and [r.info.call_id for r in w.core.unwritten()] == ["c1"]
        assert w.core.calls.record("c1")["state"] == "pending"
        fake.zadd(keys.leases("{tools}"), {"c1": 1}, xx=True)  # as if about to expire
        w._heartbeat_once()  # a pipeline of its own, not through the held outbox
        assert fake.zscore(keys.leases("{tools}"), "c1") > time.time() + settings.workers.lease / 2
        gate.set()
        assert w.core.outbox.flush(5)
        assert w.core.unwritten() == []
        assert w.core.calls.record("c1")["state"] == "done"
        assert fake.zscore(keys.leases("{tools}"), "c1") is None
        w._heartbeat_once()  # (ZADD XX: a lease that went is not brought back)
        assert fake.zscore(keys.leases("{tools}"), "c1") is None
    finally:
        gate.set()
        w.core.close()
        w.pool.shutdown()


def _submit_echo_calls(fake: Any, n: int) -> None:
    """``n`` echo calls c0, c1, ... of a tool limited to one at a time."""
    for i in range(n):
        Calls.check_submit(
            Calls(fake).submit(
                Envelope(call_id=f"c{i}", kind="tool", tool="echo", args={"i": i}, traceparent=TP, channel="hermes:ch:t"),
                ckey="tool:echo", queue_size=-1, max_attempts=1, timeout=30, concurrency=1,
            ),
            "tool:echo",
            -1,
        )


def test_a_call_ending_here_takes_the_next_waiting_one_onto_its_thread_slot(fake: Any, settings: Settings) -> None:
    """Limit 1, three calls: the worker claims the first; each ending takes the next call in its TRANSITION
    and runs it on the same thread slot (no dispatcher runs here: only the takes can start them); the last ending takes none and its
    slot goes back, so every slot is free again and each call ran once."""
    Directory(fake).register(check_spec({**TOOLS[0], "concurrency": 1}))
    w = Worker(fake, settings, ["tools"], concurrency=2, name="w-a")
    try:
        _submit_echo_calls(fake, 3)
        heard(fake)
        assert w._slots.take(1) == 1  # as the dispatcher does before its claim
        [first] = w.core.calls.claim(["tools"], 1, w.name, w.lease)
        assert first.call_id == "c0" and fake.llen(keys.queue("tools")) == 0  # the others wait for the slot
        w._run_one(first)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (w._slots.free == 2 and w.core.calls.record("c2")["state"] == "done"):
            w.core.outbox.flush(1)
            time.sleep(0.01)
        assert [w.core.calls.record(f"c{i}")["state"] for i in range(3)] == ["done"] * 3
        assert w._slots.free == 2 and w.core.processed == 3
    finally:
        w.core.close()
        w.pool.shutdown()


def test_a_call_taken_by_an_ending_does_not_count_the_ending_call_while_its_thread_winds_down(
    fake: Any, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ending call's thread is slow to reach untrack() (preempted after queuing its write): the call its
    end took begins and ends meanwhile, and its own ending still takes the next one (the first no longer
    counts among the key's calls held here, so held * peers < limit)."""
    Directory(fake).register(check_spec({**TOOLS[0], "concurrency": 1}))
    w = Worker(fake, settings, ["tools"], concurrency=2, name="w-a")
    untrack, wound_down = w.core.untrack, threading.Event()

    def slow_untrack(run: Any) -> None:
        if run.info.call_id == "c0":
            wait_until(lambda: w.core.calls.record("c1")["state"] == "done", timeout=10, message="c1 ended")
            wound_down.set()
        untrack(run)

    monkeypatch.setattr(w.core, "untrack", slow_untrack)
    try:
        _submit_echo_calls(fake, 3)
        heard(fake)
        assert w._slots.take(1) == 1
        [first] = w.core.calls.claim(["tools"], 1, w.name, w.lease)
        w._run_one(first)
        assert wound_down.is_set()
        wait_until(lambda: w._slots.free == 2 and w.core.calls.record("c2")["state"] == "done", message="c2 done")
        assert [w.core.calls.record(f"c{i}")["state"] for i in range(3)] == ["done"] * 3
    finally:
        w.core.close()
        w.pool.shutdown()


def test_a_write_whose_reply_was_lost_and_that_is_sent_again_does_not_drop_the_call(
    fake: Any, core: WorkerCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis ran the routing/executing write but its reply was lost (a socket timeout): the outbox sends it
    again and Redis answers "wrong state" — the state that write itself made. That is not another worker
    taking the call: it must run on to done, once, not be cancelled and left to the reaper."""
    import redis

    from workers import outbox

    real, lost = outbox.pipes.execute, []

    def reply_lost_once(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        replies = real(pipe, *args, **kwargs)
        if not lost:
            lost.append(replies)
            raise redis.TimeoutError("Timeout reading from socket (the reply, not the write, was lost)")
        return replies

    monkeypatch.setattr(outbox.pipes, "execute", reply_lost_once)
    submit(fake, "c1", tool="sleep", seconds=0.3)
    run_all(core)
    assert lost  # (the first write's reply was lost, and the write went again)
    assert states(fake, "c1") == ["pending", "routing", "executing", "formatting", "done"]
    assert core.calls.record("c1")["state"] == "done" and core.processed == 1


def test_an_undecodable_payload_whose_end_takes_the_next_call_gives_its_thread_slot_back_once(
    fake: Any, settings: Settings
) -> None:
    """Limit 1: the undecodable c0's failing end takes c1 onto its thread slot, as any end does; the slot
    must then pass to c1 only (it was also given back, so the dispatcher claimed past the pool's size)."""
    Directory(fake).register(check_spec({**TOOLS[0], "concurrency": 1}))
    w = Worker(fake, settings, ["tools"], concurrency=2, name="w-a")
    try:
        _submit_echo_calls(fake, 3)
        fake.hset(keys.job("c0"), "data", b"\xc1\xc1 garbage")
        heard(fake)
        assert w._slots.take(1) == 1
        [first] = w.core.calls.claim(["tools"], 1, w.name, w.lease)
        w._run_one(first)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and w.core.calls.record("c2")["state"] != "done":
            w.core.outbox.flush(1)
            time.sleep(0.01)
        w.core.outbox.flush(1)
        assert [w.core.calls.record(f"c{i}")["state"] for i in range(3)] == ["failed", "done", "done"]
        assert w._slots.free == 2  # (3 with the slot given back twice)
    finally:
        w.core.close()
        w.pool.shutdown()


def test_a_hand_back_cut_between_its_retry_and_its_requeue_is_still_requeued_by_the_schedule(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    info = submit(fake, "c1", max_attempts=3)
    _start(fake, info, [State.ROUTING, State.EXECUTING])

    def broker_gone(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("the reaper's connection dropped")

    with monkeypatch.context() as mp:
        mp.setattr(Calls, "requeue", broker_gone)
        with pytest.raises(redis.ConnectionError):
            Calls(fake).hand_back(info, attempt=1, current=State.EXECUTING, reason="worker_lost")
    assert fake.hget(keys.job("c1"), "h_state") == b"retrying"
    due = fake.zscore(keys.scheduled("{tools}"), "c1")
    assert due is not None and time.time() < due <= time.time() + 6  # a DUE scheduler requeues it then
    info2 = submit(fake, "c2", max_attempts=3)
    _start(fake, info2, [State.ROUTING])
    assert Calls(fake).hand_back(info2, attempt=1, current=State.ROUTING, reason="worker_lost")
    assert fake.zscore(keys.scheduled("{tools}"), "c2") is None  # (requeued: its safety entry is gone)
    assert fake.hget(keys.job("c2"), "h_state") == b"pending"

