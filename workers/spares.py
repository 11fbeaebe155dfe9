"""Spares: the next waiting calls of a busy key, leased to this worker ahead of a free slot.

While calls wait for a key's slots, every call of that key ending here hands its slot on (see
``Worker.reserve``). Through Redis, that costs the ending call's write being sent, run and answered, and
a thread woken, before the next call starts: on a loaded machine a few milliseconds, during which the
slot does nothing. A worker running several calls of the key therefore keeps a few *spares*: the
oldest waiting calls, taken out of the line by the script that ended an earlier call and leased to this
worker, holding no slot (they stay ``pending``). When one of its calls of the key ends, the thread that
ran it goes straight on with the oldest spare, and the ending call's write moves the slot over to that
spare in Redis (``TRANSITION``: ``take_spare``) before the spare's own first write, which follows it in
the outbox. The number of calls holding slots never grows: a slot goes from an ended call to its
successor; it only moves sooner.

A spare not started within ``SPARE_TTL`` goes back in line at its old place (``SPARE_BACK``), and the
key gets no more spares for ``SPARE_PAUSE``: its calls end too seldom for a spare to pay. A worker
shutting down gives its spares back; a dead worker's spares go back when the reaper finds their leases
expired. Spares are kept only while this worker runs at least ``SPARE_MIN_HELD`` calls of the key
(at most one spare for every ``SPARE_MIN_HELD`` of them, and ``SPARES_MAX``), so with small limits the
line is served strictly in order through Redis; with large ones, the oldest few waiting calls may start
a few milliseconds apart in a different order on different workers.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
import structlog

from broker.calls import Calls
from broker.codec import text
from broker.records import Claimed

if TYPE_CHECKING:
    from workers.outbox import Outbox

log = structlog.get_logger("hermes.worker")

SPARE_MIN_HELD = 3  # calls of a key running here before this worker keeps a spare for it
SPARES_MAX = 16  # spares per key at most
SPARE_TTL = 0.05  # seconds a spare may wait for a slot here before it goes back in line
SPARE_PAUSE = 0.2  # seconds a key gets no spares after one went back unused
ASK_MAX = 2  # spares asked for by one ending call at most


@dataclass(frozen=True)
class Spare:
    claimed: Claimed
    score: bytes  # its place in the line, to go back to
    since: float  # monotonic time it was leased to us


class Spares:
    """This worker's spares per concurrency key, and the thread that gives back those left unused."""

    def __init__(
        self, calls: Calls, worker: str, on_cancelled: Callable[[list[str]], None], outbox: Outbox | None = None
    ) -> None:
        self.calls = calls
        self.worker = worker
        self.on_cancelled = on_cancelled  # ends spares given back with a cancel asked for them
        self.outbox = outbox  # the worker's: give-backs from its sender thread go through it
        self._lock = threading.Lock()
        self._spares: dict[str, deque[Spare]] = {}
        self._asked: dict[str, int] = {}  # spares asked for per key, replies not yet read
        self._paused: dict[str, float] = {}  # key -> until when it gets no spares
        self._taken: set[str] = set()  # spares started here whose slot move is not answered yet
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.used = 0  # spares started here (the worker's ``spares_used`` figure)

    def start(self, stopping: threading.Event) -> None:
        self._thread = threading.Thread(target=self._expire_loop, args=(stopping,), name="hermes-spares", daemon=True)
        self._thread.start()

    def take(self, ckey: str, held: int, may_ask: bool = True) -> tuple[Spare | None, int]:
        """On an ending call's thread: the oldest spare of ``ckey`` (or None), and how many more to ask
        for (``held``: calls of the key running here, the ending one included)."""
        with self._lock:
            line = self._spares.get(ckey)
            spare = line.popleft() if line else None
            if spare is not None:
                self.used += 1
                self._taken.add(spare.claimed.call_id)
            if self._closed or not may_ask or time.monotonic() < self._paused.get(ckey, 0.0):
                return spare, 0
            want = min(SPARES_MAX, held // SPARE_MIN_HELD)
            have = (len(line) if line else 0) + self._asked.get(ckey, 0)
            # Every ending call here takes a spare: asking for up to two lets the stock grow back.
            ask = max(0, min(ASK_MAX, want - have))
            if ask:
                self._asked[ckey] = self._asked.get(ckey, 0) + ask
            return spare, ask

    def received(self, ckey: str, asked: int, spares: list[tuple[Claimed, bytes]], taken: str = "") -> None:
        """The reply of an ending call's write that asked for ``asked`` spares: those it leased to us
        (``taken``: the spare that write moved the slot to)."""
        with self._lock:
            self._taken.discard(taken)
            if asked:
                left = self._asked.get(ckey, 0) - asked
                if left > 0:
                    self._asked[ckey] = left
                else:
                    self._asked.pop(ckey, None)
            if not spares:
                return
            now = time.monotonic()
            # Only a first spare changes when the expiry thread must look next: later ones are younger than
            # the oldest it already waits for (waking it for each cost ~3% of a busy worker's CPU).
            first = not any(self._spares.values())
            self._spares.setdefault(ckey, deque()).extend(Spare(c, score, now) for c, score in spares)
            closed = self._closed
        if closed:  # leased to us by a write sent before we stopped taking spares: back in line now
            self.give_back(ckey, outbox=self.outbox)  # (this is the outbox's sender thread: no round trip)
            return
        if first:
            self._wake.set()

    def holds(self, ckey: str) -> bool:
        return bool(self._spares.get(ckey))

    def cancel(self, call_id: str) -> bool:
        """A caller cancelled ``call_id``: if it is one of our spares, it goes back now and ends
        ``cancelled`` (``SPARE_BACK`` leaves it out for ``on_cancelled``), instead of waiting for a slot."""
        with self._lock:
            if not self._remove(call_id):
                return False
        self._given_back(self.calls.spares_back(self.worker, [call_id]))
        return True

    def claim_handed(self, call_id: str) -> bool:
        """A call an ending write handed us: False when it is a spare already started here (the slot is
        its own now), else it is ours to start (out of the spares, if it was one)."""
        with self._lock:
            if call_id in self._taken:
                return False
            self._remove(call_id)
            return True

    def _remove(self, call_id: str) -> bool:
        """Take ``call_id`` out of the spares (under the lock); False when it is not one."""
        for key, line in self._spares.items():
            for spare in line:
                if spare.claimed.call_id == call_id:
                    line.remove(spare)
                    if not line:
                        del self._spares[key]
                    return True
        return False

    def call_ids(self) -> list[str]:
        with self._lock:
            return [s.claimed.call_id for line in self._spares.values() for s in line]

    def give_back(
        self, ckey: str | None = None, older_than: float | None = None, outbox: Outbox | None = None
    ) -> int:
        """Put spares back in line (those of ``ckey``, those waiting since before ``older_than``, or all).

        Spares that waited out ``SPARE_TTL`` pause their key (its calls end too seldom here for spares to
        pay); others (a worker shedding them) do not. ``outbox``: sent through it, after the writes
        queued so far, instead of with a round trip of its own.
        """
        with self._lock:
            out: list[Spare] = []
            for key, line in list(self._spares.items()):
                if ckey is not None and key != ckey:
                    continue
                while line and (older_than is None or line[0].since < older_than):
                    out.append(line.popleft())
                    if older_than is not None:
                        self._paused[key] = time.monotonic() + SPARE_PAUSE
                if not line:
                    del self._spares[key]
        if not out:
            return 0
        ids = [s.claimed.call_id for s in out]
        if outbox is not None:
            outbox.put(lambda pipe: self.calls.spares_back(self.worker, ids, pipeline=pipe), self._given_back)
        else:
            self._given_back(self.calls.spares_back(self.worker, ids))
        return len(out)

    def _given_back(self, cancelled: Any) -> None:
        if isinstance(cancelled, Exception):  # their leases run out; the reaper puts them back
            log.warning("could not give spares back", error=str(cancelled))
        elif cancelled:
            ids = [text(c) for c in cancelled]
            # Ending them takes round trips: not on the thread that called (the outbox's sender, maybe).
            threading.Thread(target=self.on_cancelled, args=(ids,), name="hermes-spares-cancel", daemon=True).start()

    def close(self) -> int:
        """No more spares: give back what is held (a worker stopping)."""
        with self._lock:
            self._closed = True
        self._wake.set()
        try:
            return self.give_back()
        except redis.RedisError as e:  # their leases run out; the reaper puts them back
            log.warning("could not give spares back", error=str(e))
            return 0

    def wake(self) -> None:
        self._wake.set()

    def _expire_loop(self, stopping: threading.Event) -> None:
        while not self._closed:
            if stopping.is_set():  # a stopping worker starts no spare: others may run them now
                self.close()
                return
            with self._lock:
                oldest = min((line[0].since for line in self._spares.values() if line), default=None)
            if oldest is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            wait = oldest + SPARE_TTL - time.monotonic()
            if wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            try:
                n = self.give_back(older_than=time.monotonic() - SPARE_TTL)
                if n:
                    log.debug("spares given back unused", spares=n)
            except Exception as e:  # noqa: BLE001 - the thread must go on; their leases are the fallback
                log.warning("could not give spares back", error=str(e))
                stopping.wait(0.5)
