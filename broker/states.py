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

# Per state: its letter in an ended call's kept ``steps`` (broker.calls.step_text), and RQ's own status,
# kept in the job hash so RQ's tools agree with us.
_CODES: dict[State, tuple[str, str]] = {
    State.PENDING: ("p", "queued"),
    State.ROUTING: ("r", "started"),
    State.EXECUTING: ("e", "started"),
    State.FORMATTING: ("f", "started"),
    State.DONE: ("d", "finished"),
    State.FAILED: ("x", "failed"),
    State.RETRYING: ("t", "scheduled"),
    State.CANCELLED: ("c", "canceled"),
}
STEP_CODES: dict[str, str] = {state: step for state, (step, _) in _CODES.items()}
RQ_STATUS = {state: rq for state, (_, rq) in _CODES.items()}
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


@functools.cache
def sources(target: State) -> frozenset[State]:
    """Every state from which ``target`` may be entered."""
    return frozenset(s for s, outs in TRANSITIONS.items() if target in outs)

