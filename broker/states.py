"""The call state machine: states and the transitions that connect them."""

from __future__ import annotations

import functools
from enum import StrEnum


class State(StrEnum):
    """States of a call (Tool Gateway document), plus ``cancelled``."""

    PENDING = "pending"
    ROUTING = "routing"
    EXECUTING = "executing"
    FORMATTING = "formatting"
    DONE = "done"
    FAILED = "failed"
    RETRYING = "retrying"
    CANCELLED = "cancelled"


TERMINAL = frozenset({State.DONE, State.FAILED, State.CANCELLED})

# One letter per state, as an ended call's kept ``steps`` name them (broker.calls.step_text).
STEP_CODES: dict[str, str] = {
    State.PENDING: "p",
    State.ROUTING: "r",
    State.EXECUTING: "e",
    State.FORMATTING: "f",
    State.DONE: "d",
    State.FAILED: "x",
    State.RETRYING: "t",
    State.CANCELLED: "c",
}
STEP_STATES = {code: str(state) for state, code in STEP_CODES.items()}
ACTIVE = frozenset({State.ROUTING, State.EXECUTING, State.FORMATTING})

TRANSITIONS: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.ROUTING, State.FAILED, State.CANCELLED}),
    State.ROUTING: frozenset({State.EXECUTING, State.FAILED, State.CANCELLED, State.RETRYING}),
    State.EXECUTING: frozenset({State.FORMATTING, State.FAILED, State.CANCELLED, State.RETRYING}),
    State.FORMATTING: frozenset({State.DONE, State.FAILED, State.CANCELLED, State.RETRYING}),
    State.RETRYING: frozenset({State.PENDING, State.FAILED, State.CANCELLED}),
    State.DONE: frozenset(),
    State.FAILED: frozenset(),
    State.CANCELLED: frozenset(),
}

# RQ's own status for each of our states, kept in the job hash so RQ's tools agree with us.
RQ_STATUS = {
    State.PENDING: "queued",
    State.ROUTING: "started",
    State.EXECUTING: "started",
    State.FORMATTING: "started",
    State.RETRYING: "scheduled",
    State.DONE: "finished",
    State.FAILED: "failed",
    State.CANCELLED: "canceled",
}


@functools.cache
def sources(target: State) -> frozenset[State]:
    """Every state from which ``target`` may be entered."""
    return frozenset(s for s, outs in TRANSITIONS.items() if target in outs)

