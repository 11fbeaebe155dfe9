"""A call's moves made while its last write still waits in the outbox join that write (one script)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from broker import events
from broker.calls import CallInfo, Calls
from broker.envelope import Envelope
from broker.states import State
from workers.outbox import Outbox
from workers.runner import CallRunner, Running

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _setup(fake: Any) -> tuple[CallRunner, Running, list[tuple[str, int]], Outbox]:
    calls = Calls(fake)
    env = Envelope(call_id="c1", kind="tool", tool="echo", args={}, traceparent=TP, channel="hermes:ch:t")
    calls.submit(env, ckey="tool:echo", queue_size=-1, max_attempts=1, timeout=5)
    written: list[tuple[str, int]] = []  # (final state, moves before it) per script call
    real = calls.transition

    def counting(info: Any, target: Any, **kw: Any) -> Any:
        written.append((str(target), len(kw.get("via") or ())))
        return real(info, target, **kw)

    calls.transition = calls.move = counting  # type: ignore[method-assign]  # (move is transition itself)
    outbox = Outbox(fake)
    core = SimpleNamespace(calls=calls, outbox=outbox, write=lambda _run, writer, cb: outbox.put(writer, cb))
    runner = CallRunner(core)  # type: ignore[arg-type]
    run = Running(CallInfo.of(env, "tool:echo"), env, 1)
    return runner, run, written, outbox


def _hold(outbox: Outbox) -> threading.Event:
    """Keep the outbox's sender busy until the returned event is set (writes queue up meanwhile)."""
    gate, busy = threading.Event(), threading.Event()

    def blocker(pipe: Any) -> None:
        busy.set()
        gate.wait(5)
        pipe.echo(b"")

    outbox.put(blocker)
    assert busy.wait(5)
    return gate


def test_moves_queued_behind_a_busy_sender_go_out_as_one_write_with_every_event(fake: Any) -> None:
    runner, run, written, outbox = _setup(fake)
    gate = _hold(outbox)
    runner._move(run, State.ROUTING, {"worker": "w1"})
    runner._move(run, State.EXECUTING)
    runner.publish(run, events.PROGRESS, {"message": "half way"})  # not a move: later moves start anew
    runner._move(run, State.FORMATTING)
    gate.set()
    assert outbox.flush(5)
    assert written == [("executing", 1), ("None", 0), ("formatting", 0)]
    hist = events.history(fake, "c1")
    assert [(e.seq, e.type, e.state) for e in hist] == [
        (1, "transition", "pending"),
        (2, "transition", "routing"),
        (3, "transition", "executing"),
        (4, "progress", "executing"),
        (5, "transition", "formatting"),
    ]
    assert hist[1].detail == {"worker": "w1"} and hist[1].ts <= hist[2].ts
    assert not run.lost
    outbox.close()


def test_a_move_after_the_sender_took_the_write_makes_its_own(fake: Any) -> None:
    runner, run, written, outbox = _setup(fake)
    runner._move(run, State.ROUTING)
    assert outbox.flush(5)
    runner._move(run, State.EXECUTING)
    assert outbox.flush(5)
    assert written == [("routing", 0), ("executing", 0)]
    assert [e.state for e in events.history(fake, "c1")] == ["pending", "routing", "executing"]
    outbox.close()


def test_a_refused_joined_write_marks_the_call_lost(fake: Any) -> None:
    runner, run, written, outbox = _setup(fake)
    Calls(fake).transition(run.info, State.CANCELLED, attempt=1, fence=False)  # cancelled while queued
    gate = _hold(outbox)
    runner._move(run, State.ROUTING)
    runner._move(run, State.EXECUTING)
    gate.set()
    assert outbox.flush(5)
    assert written == [("executing", 1)]
    assert run.lost
    assert [(e.seq, e.state) for e in events.history(fake, "c1")] == [(2, "cancelled")]  # nothing after it
    outbox.close()


def test_every_joined_move_hears_the_reply_even_when_one_callback_fails(fake: Any) -> None:
    runner, run, written, outbox = _setup(fake)
    heard: list[str] = []

    def check(run_: Any, target: State, reply: Any) -> None:
        heard.append(str(target))
        if target is State.ROUTING:
            raise RuntimeError("boom")

    runner._check = check  # type: ignore[method-assign]
    gate = _hold(outbox)
    runner._move(run, State.ROUTING)
    runner._move(run, State.EXECUTING)  # the last callback of a terminal write returns a hand-off
    gate.set()
    assert outbox.flush(5)
    assert written == [("executing", 1)] and heard == ["routing", "executing"]
    outbox.close()
