"""How a worker process passes the slot of a call ending on one of its threads to the next call.

The ending call's thread keeps its token for the call its slot goes to: the oldest of this process's
spares of the key (the thread goes straight on with it, see ``workers/spares.py``), else the oldest
waiting call, which the ending write leases to this process and returns (``received``). A process over
its fair share of the key's slots, a call going ``retrying`` and a stopping worker let the slot go
through the queue instead, and give their spares back in line first (``shed``).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import structlog

from broker.errors import DecodeError
from broker.records import envelope_of
from workers import reaper

if TYPE_CHECKING:
    from broker.config import Settings
    from workers.core import WorkerCore
    from workers.runner import CallRunner
    from workers.spares import Spares
    from workers.threads import CallThreads, Tokens

log = structlog.get_logger("hermes.worker")

# After an ending call found nobody waiting for its slot, how long its key's calls end without a hand-off.
HANDOFF_RETRY = 0.05


class HandOff:
    """The hand-off part of ``workers.worker.Worker`` (it provides these attributes)."""

    name: str
    lease: float
    settings: Settings
    core: WorkerCore
    runner: CallRunner
    pool: CallThreads
    spares: Spares
    stopping: threading.Event
    _slots: Tokens
    _local: threading.local
    _no_waiters: dict[str, float]
    _slotless: set[str]
    _slotted: set[str]
    fair_share: Any

    def _run_one(self, claimed: Any) -> None:
        local = self._local
        while claimed is not None:
            local.in_call, local.keep, local.next = True, False, None
            try:
                self.runner.run(claimed)
            except Exception:  # noqa: BLE001 - run() never raises; if it did, the spare and token still go on
                log.exception("call thread failed")
            finally:
                local.in_call = False
                claimed = local.next  # a spare this thread goes on with, on the slot the call released
                if claimed is not None and self.stopping.is_set():
                    self._requeue_spare(claimed)  # a stopping worker starts nothing new
                    claimed, local.keep = None, False
                if not local.keep:
                    self._slots.give()

    def _requeue_spare(self, claimed: Any) -> None:
        """A spare this thread was to go on with as the worker stops: back at the head of its queue with
        the slot its predecessor's write moved to it (after that write: through the outbox), else back in
        line if it is still our spare."""
        try:
            env = envelope_of(claimed.data)
        except DecodeError:
            return  # its lease runs out and the reaper settles it
        calls, ckey, cid = self.core.calls, self.core.ckey_of(env), claimed.call_id

        def write(pipe: Any) -> None:
            calls.requeue_unstarted(cid, ckey, env.queue, pipeline=pipe)
            calls.spares_back(self.name, [cid], pipeline=pipe)

        self.core.outbox.put(write)

    def _run_extra(self, claimed: Any) -> None:
        """A call handed to us beyond our threads' tokens (rare: see ``received``)."""
        local = self._local
        local.in_call, local.keep, local.next, local.extra = False, True, None, True
        try:
            self.runner.run(claimed)
        finally:
            local.extra = False

    # -- hand-off: the slot a call frees goes straight to the next waiting call, on this worker ----

    def reserve(self, ckey: str, queue: str, call_id: str = "") -> tuple[str, float, str, int] | None:
        """On a call's thread as it ends: keep its thread for the call its slot is handed to: the oldest
        spare of the key (this thread goes on with it at once), else the oldest waiting call (see
        ``received``). Returns the ``handoff`` of the ending call's write: (worker, lease, spare, spares
        to ask for).

        Declined while this process holds more than its fair share of the key's slots (the limit over
        the live workers of the queue): the slot then goes to the waiting call through the queue, where
        a less busy worker takes it. Without that, whichever worker was first at the start would keep
        every slot for good, its threads contending for one GIL while the other processes idle.
        """
        local = self._local
        if getattr(local, "extra", False):
            self.shed(ckey)  # a call beyond our tokens: its slot goes through the queue
            return None
        if not getattr(local, "in_call", False) or local.keep:
            return None
        if call_id in self._slotless:  # a spare whose slot move was refused: it has no slot to pass on
            self._slotless.discard(call_id)
            return None
        held = self.core.held(ckey)
        if self.stopping.is_set() or held > self.fair_share(ckey, queue):
            self.shed(ckey)  # the slot goes through the queue: our spares go back in line ahead of it
            return None
        # Holding the thread until the write is flushed only pays when calls wait for this key's slots;
        # after a miss, ask again only now and then (a waiting call is still promoted onto the queue).
        quiet = time.monotonic() < self._no_waiters.get(ckey, 0.0)
        # Spares only while this process holds at most floor(limit / live workers) of the key's slots: the
        # slots its threads pass on without asking Redis then never add up to more than the limit.
        if held <= self.fair_share(ckey, queue, floor=True):
            spare, ask = self.spares.take(ckey, held, may_ask=not quiet)
        else:
            self.shed(ckey)
            spare, ask = None, 0
        if spare is None and quiet:
            return None
        local.keep = True
        if spare is not None:
            local.next = spare.claimed
            return self.name, self.lease, spare.claimed.call_id, ask
        return self.name, self.lease, "", ask

    def received(self, reply: Any, ckey: str, handoff: tuple[str, float, str, int]) -> None:
        """The reply of an ending transition that reserved: keep the spare it leased to us, run the call
        it handed to us, else free the thread (unless that thread went on with a spare)."""
        calls = self.core.calls
        self.spares.received(ckey, handoff[3], calls.spared(reply), handoff[2])
        claimed = calls.handed_off(reply)
        # A spare of ours may come handed (our oldest, ahead of younger waiting calls): unless a thread
        # here already went on with it, it leaves the spares and starts now.
        start = claimed is not None and self.spares.claim_handed(claimed.call_id)
        if claimed is not None and not start:
            # A thread here went on with it, naming it in a write that Redis runs after this one: this
            # slot is its own now, and that write will find it moved already.
            self._slotted.add(claimed.call_id)
        if handoff[2] and not calls.spare_moved(reply):
            if handoff[2] in self._slotted:
                self._slotted.discard(handoff[2])
            else:
                # Refused (our lease on the ending call was taken over, or it was not our spare any more):
                # the spare runs without a slot, so its own end passes none on to a next spare.
                self._slotless.add(handoff[2])
                log.warning("a spare started without its slot", call_id=handoff[2])
        if handoff[2]:  # the thread went on with a spare; a call handed to us means the spare was not ours
            if start:  # (another write of ours gave it a slot first: that write's thread gave its token back)
                self._start(claimed, self._run_one if self._slots.take(1, 0) else self._run_extra)
            return
        if not start:
            if claimed is None:
                self._no_waiters[ckey] = time.monotonic() + HANDOFF_RETRY
            self._slots.give()
            return
        self._no_waiters.pop(ckey, None)
        self._start(claimed, self._run_one)

    def shed(self, ckey: str) -> None:
        """Give this key's spares back in line (a slot of ours goes through the queue, or we stop)."""
        if self.spares.holds(ckey) and self.spares.give_back(ckey, outbox=self.core.outbox):
            self._local.shed = True

    def shed_now(self) -> bool:
        """Whether this thread just queued a give-back of spares (the write that frees its slot must go
        after it, not join an earlier one); cleared by asking."""
        shed, self._local.shed = getattr(self._local, "shed", False), False
        return shed

    def _start(self, claimed: Any, run: Any) -> None:
        try:
            self.pool.submit(run, claimed)
        except RuntimeError:  # pool shut down: the call stays leased and the reaper settles it
            if run == self._run_one:
                self._slots.give()

    def _end_cancelled(self, call_ids: list[str]) -> None:
        """Spares given back that a caller cancelled meanwhile: they end ``cancelled`` here."""
        for call_id in call_ids:
            try:
                reaper.end_cancelled(self.core.calls, call_id, self.settings.result_ttl, self.core.audit)
            except Exception:  # noqa: BLE001 - one bad record must not stop the others
                log.exception("could not end a cancelled spare", call_id=call_id)
