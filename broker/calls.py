"""Call records in Redis: submit, transition, claim, lease and reap, each one atomic script.

What a record holds (``CallInfo``, the job fields, the envelope in it, times and scores) is in
``broker.records``.

Every write takes an optional ``pipeline``; only the creator of a pipeline executes it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import redis
from redis.client import Pipeline

from . import events, keys, pipes, scripts
from .errors import IllegalTransition
from .records import CallInfo, Step, read_record, waiting_score
from .settings import DEFAULT_RESULT_TTL
from .states import RQ_STATUS, TERMINAL, State, sources
from .submits import F_DIGEST, F_IDEM, SUBMIT_TTL, Submits

# Reasons a transition script refused.
MISSING, FENCED, WRONG_STATE = -1, -2, -3


__all__ = ["F_DIGEST", "F_IDEM", "SUBMIT_TTL", "Calls"]


class Calls(Submits):
    """Scripted operations on call records: transitions here, submission in ``Submits``, the workers'
    side (claims and leases) in ``Claims``."""

    def __init__(self, conn: redis.Redis) -> None:
        super().__init__(conn)
        self._transition = conn.register_script(scripts.for_server(conn, scripts.TRANSITION))
        # An ended call keeps its terminal event alone, unless `workers.keep_history` (set by the owner).
        self.keep_history = False

    # -- transitions -----------------------------------------------------------------------------

    def transition(
        self,
        info: CallInfo,
        target: State | None,
        *,
        attempt: int,
        detail: dict[str, Any] | None = None,
        fence: bool = True,
        from_states: frozenset[State] | None = None,
        lease: float | str | None = None,
        requeue: bool = False,
        requeue_first: bool = False,
        schedule_at: float | None = None,
        fields: dict[str, Any] | None = None,
        ttl: int | None = None,
        event_type: str = events.TRANSITION,
        current: State | None = None,
        pipeline: Pipeline | None = None,
        via: Sequence[Step] = (),
        ts: float | None = None,
        unleased: bool = False,
        used_tokens: int | None = None,
        sent: bool = True,
    ) -> Any:
        """Move a call to ``target`` (or publish a non-state event when None), atomically with its event.

        ``via``: moves made before this one that were not written yet, ``(state, detail, ts)`` each in
        order, the first from ``current``; their events are recorded and published first, in the same
        script. ``ts``: when this move happened (default now). ``unleased``: only from ``pending`` while no
        worker holds the call (a caller cancelling it directly; a worker that took it is told instead).

        Ending (or ``retrying``) releases the call's concurrency slot and promotes the next waiting call
        of its key (fair order, broker/lua/slots.lua); ``requeue`` admits it again (a free slot, else
        waiting for its fairness key's next turn, or with ``requeue_first`` before every waiting call);
        ``schedule_at`` puts a ``retrying`` call on the scheduled set, due at that time. Releasing settles
        the call's rate-limiter entry with ``used_tokens`` (None: its estimate stands); ``sent`` False says
        its request never left (the entry is given back), else one not stamped yet counts from now.
        """
        release = target is not None and (target in TERMINAL or target is State.RETRYING)
        if via and target is None:
            raise ValueError("earlier moves ride only with a state change")
        early: list[bytes] = []
        first: frozenset[State] | None = None  # what the state in Redis must be: the first move's sources
        for state_, detail_, ts_ in via:  # each checked as if it were written alone
            first = self._check_move(current, state_, from_states if first is None else None, first)
            early.append(self._event(info, str(state_), attempt, events.TRANSITION, detail_, ts_))
            current = state_
        if target is not None:
            allowed = self._check_move(current, target, from_states if first is None else None, first)
            src = "pending!" if unleased else _joined(allowed)
            state = str(target)
            if target in TERMINAL:  # (the script keeps only what an ended record needs: see transition.lua)
                lease = "-"
                ttl = ttl or DEFAULT_RESULT_TTL
        else:
            src, state = "", ""
        ev = self._event(info, state or (str(current) if current else ""), attempt, event_type, detail, ts)
        flat: list[Any] = [len(early), *early]
        for k, v in (fields or {}).items():
            flat.append(k)
            flat.append(v)
        tag = keys.tag(info.queue)
        return pipes.script(
            self._transition,
            [
                keys.job(info.call_id),
                keys.history(info.call_id),
                keys.leases(tag),
                keys.waiting(tag, info.ckey),
                keys.slots(tag, info.ckey),
                keys.limits(tag),
                keys.scheduled(tag),
                keys.queue(info.queue),
                keys.waiting_batch(tag, info.ckey),
                keys.fair(tag, info.ckey),
                keys.rate(tag, info.ckey),
                keys.rate_log(tag, info.ckey),
                keys.rate_due(tag),
            ],
            [
                info.call_id,
                ev,
                "" if ttl is None else ttl,
                str(attempt) if fence else "",
                src,
                state,
                RQ_STATUS[target] if target is not None else "",
                "" if lease is None else lease,
                "1" if requeue else "",
                "first" if requeue_first else "",
                info.channel,
                "1" if release else "",
                info.ckey,
                "" if schedule_at is None else schedule_at,
                self.wake_channel(info.queue),
                self.publish,
                keys.job(""),
                waiting_score() if requeue else "",
                "-" if not sent else "" if used_tokens is None else used_tokens,
                "1" if self.keep_history else "",
                *flat,
            ],
            pipeline,
        )

    # -- named operations (each one TRANSITION) ----------------------------------------------------

    def move(
        self,
        info: CallInfo,
        target: State,
        *,
        attempt: int,
        current: State | None,
        detail: dict[str, Any] | None = None,
        via: Sequence[Step] = (),
        ts: float | None = None,
        fields: dict[str, Any] | None = None,
        ttl: int | None = None,
        pipeline: Pipeline | None = None,
        used_tokens: int | None = None,
        sent: bool = True,
    ) -> Any:
        """A worker moves the call it holds (fenced by ``attempt``), with the moves ``via`` not written yet;
        a terminal ``target`` ends it (``fields``: result or error, ``ttl``: how long the record stays;
        ``used_tokens`` / ``sent``: its rate limiter's settlement, see ``transition``)."""
        return self.transition(
            info,
            target,
            attempt=attempt,
            current=current,
            detail=detail,
            via=via,
            ts=ts,
            fields=fields,
            ttl=ttl,
            pipeline=pipeline,
            used_tokens=used_tokens,
            sent=sent,
        )

    def note(
        self,
        info: CallInfo,
        event_type: str,
        detail: dict[str, Any],
        *,
        attempt: int,
        current: State | None,
        ts: float | None = None,
        pipeline: Pipeline | None = None,
    ) -> Any:
        """An event that changes no state (progress, a stream delta), fenced like a move."""
        return self.transition(
            info,
            None,
            attempt=attempt,
            detail=detail,
            event_type=event_type,
            current=current,
            ts=ts,
            pipeline=pipeline,
        )

    def finish(
        self, info: CallInfo, target: State, *, attempt: int, current: State, error: dict[str, Any], ttl: int
    ) -> Any:
        """End a call with ``error`` (``failed`` or ``cancelled``) on behalf of a lost worker."""
        return self.transition(
            info,
            target,
            attempt=attempt,
            current=current,
            detail={"error": error},
            ttl=ttl,
        )

    def retry(
        self,
        info: CallInfo,
        *,
        attempt: int,
        current: State,
        detail: dict[str, Any],
        due: float | None = None,
        pipeline: Pipeline | None = None,
    ) -> Any:
        """The attempt ends ``retrying``: its lease and slot go, the next attempt is counted and, with
        ``due``, put on the schedule."""
        return self.transition(
            info,
            State.RETRYING,
            attempt=attempt,
            current=current,
            detail=detail,
            lease="-",
            schedule_at=due,
            fields={keys.F_ATTEMPT: attempt + 1},
            pipeline=pipeline,
        )

    def requeue(
        self, info: CallInfo, *, attempt: int, first: bool = False, pipeline: Pipeline | None = None
    ) -> Any:
        """A ``retrying`` call is admitted again: a free slot, else it waits for its fairness key's next
        turn (``first``: before every waiting call)."""
        return self.transition(
            info,
            State.PENDING,
            attempt=attempt,
            requeue=True,
            requeue_first=first,
            lease="-",
            current=State.RETRYING,
            pipeline=pipeline,
        )

    def hand_back(
        self, info: CallInfo, *, attempt: int, current: State, reason: str, free: bool = False
    ) -> bool:
        """A running call goes back before every waiting call as its next attempt (``free``: an
        attempt that does not count, its worker stopped); False when it was no longer this attempt's."""
        reply = self.retry(
            info, attempt=attempt, current=current, detail={"reason": reason, "next_attempt": attempt + 1}
        )
        if int(reply[0]) <= 0:
            return False
        if free:
            self.conn.hincrby(keys.job(info.call_id), keys.F_MAX_ATTEMPTS, 1)
        self.requeue(info, attempt=attempt + 1, first=True)
        return True

    def cancel_unleased(
        self, info: CallInfo, *, attempt: int, error: dict[str, Any], pipeline: Pipeline | None = None
    ) -> Any:
        """A caller cancels a call still ``pending`` that no worker holds."""
        return self.transition(
            info,
            State.CANCELLED,
            attempt=attempt,
            fence=False,
            from_states=frozenset({State.PENDING}),
            unleased=True,
            detail={"error": error},
            pipeline=pipeline,
        )

    @staticmethod
    def _check_move(
        current: State | None,
        target: State,
        from_states: frozenset[State] | None,
        first: frozenset[State] | None,
    ) -> frozenset[State]:
        """Refuse an illegal move; returns the sources the script checks (the first move's)."""
        allowed = from_states if from_states is not None else sources(target)
        if current is not None and current not in allowed:
            raise IllegalTransition(
                f"illegal transition {current} -> {target}", current=str(current), target=str(target)
            )
        return first if first is not None else allowed

    @staticmethod
    def _event(
        info: CallInfo,
        state: str,
        attempt: int,
        event_type: str,
        detail: dict[str, Any] | None,
        ts: float | None,
    ) -> bytes:
        return events.payload(
            call_id=info.call_id,
            state=state,
            trace_id=info.trace_id,
            span_id=info.span_id,
            attempt=attempt,
            kind=info.kind,
            name=info.name,
            session_id=info.session_id,
            type=event_type,
            detail=detail,
            ts=ts,
        )

    def load_scripts(self) -> None:
        """Load the scripts the hot paths queue into pipelines, so that none is refused (NOSCRIPT) and
        rerun after the commands queued behind it: writes of a worker depend on their order."""
        for script in (self._transition, self._requeue, self._submit):
            self.conn.script_load(script.script)

    # -- reading ---------------------------------------------------------------------------------

    def record(self, call_id: str) -> dict[str, Any] | None:
        """The call's record as plain values (state, attempt, result, error, ...)."""
        return read_record(self.conn, call_id)


@functools.lru_cache(maxsize=256)
def _joined(states: frozenset[State]) -> str:
    """The sources a script checks, as its ``a,b,c`` argument (a few distinct sets, each joined once)."""
    return ",".join(sorted(states))
