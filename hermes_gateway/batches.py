"""Batches: one model behind both clients, the CLI, the HTTP API and the console.

A batch is a meta hash (``hermes:batch:<id>``) and, per queue tag, result keys its calls' own TRANSITION
writes (``hermes:batch:{q}:<id>:r|x|o|n``). Item ``i``'s call id and partition derive from (batch id, i), so
submitting it again finds the same call. The submitter streams items in chunks, at most ``window``
unfinished (a ``QueueFull`` item waits and goes again): O(window) memory. Resume submits every item again;
those with a result are skipped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from broker import durability, events, keys, scripts
from broker.calls import Calls
from broker.codec import pack, raw, text, unpack
from broker.errors import CallCancelled, DecodeError, HermesError, InvalidArgs, QueueFull, UnknownBatch
from hermes_gateway.clientcore import CallOptions, tool_envelope, tool_limits

if TYPE_CHECKING:
    from hermes_gateway.client import Gateway

CHUNK = 20  # items per pipelined round trip (other clients wait behind a pipeline; docs/decisions.md)
CANCEL_THREADS = 8  # calls a batch cancel cancels at once (each a few round trips)
READ_CHUNK = 500  # results read per round trip
POLL = 0.2  # seconds between looks at the counters while waiting
SENDING_STALE = 30.0  # seconds after which a chunk marked in flight is taken as its submitter's death
ENDED = ("done", "failed", "cancelled")  # the counters of :n (the terminal states)


def item_call_id(batch_id: str, index: int) -> str:
    """The unique part of item ``index``'s call id: the same whenever the item is submitted."""
    return hashlib.blake2b(f"{batch_id}:{index}".encode(), digest_size=16).hexdigest()


def check_batch_id(batch_id: str) -> str:
    """A batch id as given by a user: 1–64 characters of ``[0-9A-Za-z_-]`` (it is part of keys)."""
    if not isinstance(batch_id, str) or not 0 < len(batch_id) <= 64 or not all(
        c.isalnum() or c in "-_" for c in batch_id
    ):
        raise UnknownBatch(f"no such batch {batch_id!r}: an id is 1-64 letters, digits, '-' or '_'")
    return batch_id


@dataclass(frozen=True)
class Progress:
    """Where a batch stands, read from Redis."""

    id: str
    tool: str
    state: str  # submitting | submitted | cancelled | stopped (of the submission; stopped: its submitter failed)
    total: int | None  # items, once the submitter has read them all
    submitted: int  # items sent so far (the high-water mark)
    counts: dict[str, int]  # done / failed / cancelled
    created: float
    started: float
    ended: float | None  # when the last call ended (once finished)
    principal: str = ""  # who made it ('' none): only they (and admins) see it over HTTP
    sending: bool = False  # a submitter is sending a chunk (its items are not yet counted in ``submitted``)
    error: str = ""  # what stopped the submitter (state ``stopped``)

    @property
    def finished(self) -> int:
        return sum(self.counts.values())

    @property
    def complete(self) -> bool:
        """Every item sent has ended and nothing more will be sent."""
        return self.state != "submitting" and not self.sending and self.finished >= self.submitted

    @property
    def rate(self) -> float:
        """Calls ended per second since the first submission."""
        span = (self.ended or time.time()) - self.started
        return self.finished / span if span > 0 else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds until every item has ended at the current rate (None: unknown)."""
        if self.complete:
            return 0.0
        rate = self.rate
        return (self.total - self.finished) / rate if rate > 0 and self.total is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tool": self.tool,
            "state": "finished" if self.complete and self.state == "submitted" else self.state,
            "total": self.total,
            "submitted": self.submitted,
            "finished": self.finished,
            "running": max(0, self.submitted - self.finished),
            "counts": {s: self.counts.get(s, 0) for s in ENDED},
            "created": self.created,
            "rate": round(self.rate, 3),
            "eta": None if self.eta is None else round(self.eta, 3),
            "complete": self.complete,
            **({"error": self.error} if self.error else {}),
        }


@dataclass(frozen=True)
class Item:
    """One item's outcome: ``{index, call_id, state, result | error}``."""

    index: int
    call_id: str
    state: str
    result: Any = None
    error: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        end = {"error": self.error} if self.error is not None else {"result": self.result}
        return {"index": self.index, "call_id": self.call_id, "state": self.state, **end}


@dataclass
class Cursor:
    """How far a reader of a batch's results has come: an offset into each queue's completion list."""

    offsets: dict[str, int] = field(default_factory=dict)


def _item(index: int, entry: bytes, big: bytes | None) -> Item:
    try:
        ev = events.decode(entry)
    except DecodeError as e:
        return Item(index, "", "failed", error={"type": "bad_payload", "message": f"unreadable result: {e}"})
    detail = ev.detail
    error = detail.get("error") if ev.state != "done" else None
    if ev.state != "done" and not isinstance(error, dict):
        error = {"type": ev.state, "message": f"the call ended {ev.state}"}
    result = unpack(big) if big is not None else detail.get("result")
    return Item(index, ev.call_id, ev.state, None if error else result, error)


class BatchStore:
    """A batch's Redis side: meta, progress, results, cancel, and the submission loop."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._state = conn.register_script(scripts.BATCH_STATE)
        self._unsent = conn.register_script(scripts.BATCH_UNSENT)

    # -- meta ----------------------------------------------------------------------------------

    def create(self, tool: str, queues: list[str], *, ttl: int, window: int, principal: str | None = None) -> str:
        batch_id = uuid.uuid4().hex[:20]
        now = time.time()
        meta = {
            "tool": tool,
            "queues": ",".join(queues),
            "state": "submitting",
            "submitted": 0,
            "created": now,
            "started": now,
            "ttl": ttl,
            "window": window,
            "principal": principal or "",
        }
        pipe = self.conn.pipeline(transaction=False)
        pipe.hset(keys.batch(batch_id), mapping=meta)
        pipe.expire(keys.batch(batch_id), ttl)
        pipe.zadd(keys.BATCHES, {batch_id: now})
        # (entries picked at random, not the oldest: long-lived batches at its head would stop the pruning)
        pipe.zrandmember(keys.BATCHES, CHUNK, withscores=True)
        picked = pipe.execute()[-1]
        old = [bid for bid, at in zip(picked[0::2], picked[1::2], strict=True) if float(at) <= now - ttl]
        if old:  # batches made before this one's TTL began leave the list once their meta is gone
            pipe = self.conn.pipeline(transaction=False)
            for bid in old:
                pipe.exists(keys.batch(text(bid)))
            if gone := [bid for bid, there in zip(old, pipe.execute(), strict=True) if not there]:
                self.conn.zrem(keys.BATCHES, *gone)
        return batch_id

    def set_state(self, batch_id: str, state: str, ttl: int, **fields: Any) -> str:
        """Set the batch's state (with ``fields``) unless it was cancelled, refreshing its TTL; returns the
        state before ('' when the batch is gone: nothing written)."""
        flat = [x for k, v in fields.items() for x in (k, v)]
        return text(self._state(keys=[keys.batch(batch_id)], args=[state, ttl, *flat]) or b"")

    def meta(self, batch_id: str) -> dict[str, str]:
        raw_meta = self.conn.hgetall(keys.batch(check_batch_id(batch_id)))
        meta = {text(k): text(v) for k, v in raw_meta.items()}
        if "tool" not in meta or "queues" not in meta:  # (none, or a late write's remains after it expired)
            raise UnknownBatch(f"no such batch {batch_id!r} (never made, or past its batch.ttl)", batch_id=batch_id)
        return meta

    def progress(self, batch_id: str, meta: dict[str, str] | None = None) -> Progress:
        meta = meta or self.meta(batch_id)
        counts = self.counts(batch_id, meta["queues"].split(","))
        submitted, sending = _sent(meta)
        p = Progress(
            id=batch_id, tool=meta["tool"], state=meta.get("state", "submitting"),
            total=int(meta["total"]) if meta.get("total") else None,
            submitted=submitted, counts=counts, created=float(meta.get("created") or 0),
            started=float(meta.get("started") or 0),
            ended=float(meta["ended"]) if meta.get("ended") else None, principal=meta.get("principal", ""),
            sending=sending, error=meta.get("error", ""),
        )
        if p.complete and p.ended is None:  # the first reader to see it finished stamps the end (rate, ETA)
            now = time.time()
            self.conn.hsetnx(keys.batch(batch_id), "ended", now)
            p = dataclasses.replace(p, ended=now)
        return p

    def counts(self, batch_id: str, queues: list[str]) -> dict[str, int]:
        """Calls of the batch ended so far, per terminal state (summed over its queues' counters)."""
        pipe = self.conn.pipeline(transaction=False)
        for q in queues:
            pipe.hgetall(keys.batch_part(q, batch_id) + ":n")
        counts: dict[str, int] = {}
        for reply in pipe.execute():
            for k, v in reply.items():
                counts[text(k)] = counts.get(text(k), 0) + int(v)
        return counts

    def recent(self, limit: int = 100, principal: str | None = None) -> list[Progress]:
        """The newest ``limit`` batches still on record, newest first; only ``principal``'s when given (read
        further down the list: the newest batches may all be others' or gone)."""
        out: list[Progress] = []
        at = 0
        while len(out) < limit and (page := self.conn.zrevrange(keys.BATCHES, at, at + READ_CHUNK - 1)):
            ids, at = [text(b) for b in page], at + len(page)
            pipe = self.conn.pipeline(transaction=False)
            for bid in ids:
                pipe.hget(keys.batch(bid), "principal")
            for bid, who in zip(ids, pipe.execute(), strict=True):
                if who is not None and principal in (None, text(who)) and len(out) < limit:
                    with contextlib.suppress(UnknownBatch):
                        out.append(self.progress(bid))
        return out

    # -- results -------------------------------------------------------------------------------

    def read(self, batch_id: str, queues: list[str], cursor: Cursor) -> list[Item]:
        """The results that ended after ``cursor`` (at most READ_CHUNK per queue); moves the cursor on."""
        pipe = self.conn.pipeline(transaction=False)
        for q in queues:
            at = cursor.offsets.get(q, 0)
            pipe.lrange(keys.batch_part(q, batch_id) + ":o", at, at + READ_CHUNK - 1)
        lists = pipe.execute()
        pipe = self.conn.pipeline(transaction=False)
        wanted: list[tuple[str, list[bytes]]] = []
        for q, idx in zip(queues, lists, strict=True):
            if idx:
                part = keys.batch_part(q, batch_id)
                pipe.hmget(part + ":r", idx)
                pipe.hmget(part + ":x", idx)
                wanted.append((q, idx))
        if not wanted:
            return []
        replies = pipe.execute()
        items = []
        for (q, idx), entries, bigs in zip(wanted, replies[0::2], replies[1::2], strict=True):
            for i, entry, big in zip(idx, entries, bigs, strict=True):
                if entry is not None:
                    items.append(_item(int(i), raw(entry), None if big is None else raw(big)))
            cursor.offsets[q] = cursor.offsets.get(q, 0) + len(idx)
        return items

    def pages(self, batch_id: str, follow: bool, stop: Callable[[], bool]) -> Iterator[list[Item]]:
        """Every result in the order the calls ended, each index once, a page per read; with ``follow``,
        until complete (or ``stop()``). An empty page: none yet (wait ``POLL`` before the next)."""
        queues = self.meta(batch_id)["queues"].split(",")
        cursor = Cursor()
        while True:
            done_before = self.progress(batch_id).complete if follow else True  # read before the results
            items = self.read(batch_id, queues, cursor)
            if not items and (done_before or stop()):
                return
            yield items

    def results(self, batch_id: str, follow: bool, stop: Callable[[], bool]) -> Iterator[Item]:
        """The results of ``pages``, one by one."""
        for items in self.pages(batch_id, follow, stop):
            yield from items
            if not items:
                time.sleep(POLL)

    def wait(self, batch_id: str, timeout: float | None = None) -> Progress:
        """Block until the batch is complete (or ``timeout`` seconds: its progress then, not complete)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            p = self.progress(batch_id)
            if p.complete or (deadline is not None and time.monotonic() >= deadline):
                return p
            time.sleep(POLL)

    def write_unsent(self, batch_id: str, queue: str, index: int, ttl: int, error: HermesError,
                     state: str = "failed") -> None:
        """The result of an item that never became a call: refused (bad arguments, ``failed``) or
        ``cancelled`` while it waited for room in a full queue."""
        entry = pack({"call_id": "", "seq": 0, "state": state, "type": events.TRANSITION,
                      "detail": {"error": error.to_wire()}})
        part = keys.batch_part(queue, batch_id)
        self._unsent(keys=[part + ":r", part + ":o", part + ":n"], args=[index, entry, state, ttl])

    def write_cancelled(self, batch_id: str, queue: str, index: int, ttl: int) -> None:
        """The ``cancelled`` result of an item the batch's cancel caught before it was sent."""
        self.write_unsent(batch_id, queue, index, ttl,
                          CallCancelled("the batch was cancelled before this item was sent"), state="cancelled")

    # -- cancel --------------------------------------------------------------------------------

    def cancel(self, gw: Gateway, batch_id: str) -> int:
        """Stop the submission and cancel every call of the batch not yet ended; returns how many. A batch
        whose every item has ended is left as it is (finished, not relabelled cancelled)."""
        if self.progress(batch_id).complete:
            return 0
        self.conn.hset(keys.batch(batch_id), "state", "cancelled")
        meta = self.meta(batch_id)  # (read after the state: the submitter stops)
        queue_of = _router(meta)
        counted = int(meta.get("submitted") or 0)
        upto, _ = _sent(meta)  # (a live submitter cancels its own chunk; a dead one's chunk is ours)
        def one(i: int) -> bool:
            if gw.cancel(keys.call_id(queue_of(i), item_call_id(batch_id, i))):
                return True
            if i >= counted:  # the dead submitter's chunk: this item never became a call
                self.write_cancelled(batch_id, queue_of(i), i, int(meta["ttl"]))
            return False

        # From the last item back, several at once: the workers take the first ones meanwhile, so a cancel in
        # item order, one round trip after another, chased them and caught almost none of a fast tool's calls.
        cancelled = 0
        with concurrent.futures.ThreadPoolExecutor(CANCEL_THREADS, thread_name_prefix="hermes-cancel") as pool:
            for end in range(upto, 0, -CHUNK * CANCEL_THREADS):
                idx = range(end - 1, max(0, end - CHUNK * CANCEL_THREADS) - 1, -1)
                left = [i for i, has in zip(idx, self.has_result(batch_id, queue_of, idx), strict=True) if not has]
                cancelled += sum(pool.map(one, left))
        return cancelled

    def has_result(self, batch_id: str, queue_of: Callable[[int], str], indexes: Iterable[int]) -> list[Any]:
        """Whether each of the items ``indexes`` has its result, in one round trip."""
        pipe = self.conn.pipeline(transaction=False)
        for i in indexes:
            pipe.hexists(keys.batch_part(queue_of(i), batch_id) + ":r", i)
        return pipe.execute()


def _sending_mark(end: int) -> str:
    """The meta's ``sending`` field: a chunk up to item ``end`` in flight since now (``_sent`` reads it)."""
    return f"{time.time()} {end}"


def _sent(meta: dict[str, str]) -> tuple[int, bool]:
    """(the items sent, whether a live submitter has a chunk in flight): the high-water mark, and past it a
    chunk whose mark is older than ``SENDING_STALE`` (its submitter died: its calls may have gone out)."""
    counted = int(meta.get("submitted") or 0)
    at, _, end = meta.get("sending", "").partition(" ")
    if not at:
        return counted, False
    if time.time() - float(at) < SENDING_STALE:
        return counted, True
    return max(counted, int(end or 0)), False


def _router(meta: dict[str, str]) -> Callable[[int], str]:
    """Item index -> its queue (its partition, from the index, when the tool is split)."""
    queues = meta["queues"].split(",")
    return lambda i: queues[i % len(queues)]


def batch_queues(spec: Any, settings: Any) -> list[str]:
    """The queues of a batch of ``spec``: its queue, or each partition with a share of the limit."""
    queue = str(spec.config.get("queue") or "tools")
    n = keys.partition_count(spec)
    if n <= 1:
        return [queue]
    concurrency = spec.concurrency or settings.concurrency_for(spec.executor)
    usable = n if concurrency < 0 else min(n, concurrency)
    return [keys.partition_name(queue, n, i) for i in range(usable)]


class Submitter:
    """One pass over a batch's items: chunks of SUBMIT in one pipeline each, at most ``window`` unfinished."""

    def __init__(self, store: BatchStore, gw: Gateway, batch_id: str, meta: dict[str, str], *, resume: bool,
                 context: dict[str, Any]) -> None:
        self.store, self.gw, self.id, self.meta = store, gw, batch_id, meta
        self.conn = store.conn
        self.resume = resume
        self.context = context
        self.ttl = int(meta["ttl"])
        self.window = max(1, int(meta["window"]))
        self.entry = gw.directory.get(meta["tool"])
        self.queue_of = _router(meta)
        # The high-water mark: every item before it was accepted (or has a result); never lowered (a resumed
        # batch's items before it all went out once).
        self.sent = int(meta.get("submitted") or 0) if resume else 0
        self.cancelled = False

    def channel(self, queue: str) -> str:
        # (nobody listens per call: the batch's channel, sharded in the call's slot on a cluster)
        return keys.caller_channel("batch." + self.id, keys.tag(queue) if self.gw.cluster else "")

    def run(self, items: Iterable[Any]) -> None:
        # (the state is "submitting" already: setting it here could undo a cancel that came first)
        self.gw.workers.ensure(self.meta["queues"].split(","))
        numbered = enumerate(items)
        count = 0
        while chunk := list(itertools.islice(numbered, min(CHUNK, self.window))):
            self.send(chunk)
            count = chunk[-1][0] + 1
            if self.cancelled:
                return
        self.store.set_state(self.id, "submitted", self.ttl, total=count, submitted=max(count, self.sent))

    def finished(self) -> int:
        return sum(self.store.counts(self.id, self.meta["queues"].split(",")).values())

    def make_room(self, n: int) -> None:
        """Wait while more than ``window`` calls would be unfinished (the counters in Redis say)."""
        delay = 0.01
        while self.sent + n - self.finished() > self.window:
            if self.is_cancelled():
                return
            time.sleep(delay)
            delay = min(POLL, delay * 2)

    def is_cancelled(self) -> bool:
        """Cancelled, or gone (past its TTL): either way nothing more is sent."""
        if text(self.conn.hget(keys.batch(self.id), "state") or b"cancelled") == "cancelled":
            self.cancelled = True
        return self.cancelled

    def begin(self, end: int) -> bool:
        """Mark the chunk up to ``end`` in flight (a reader must not take a cancelled batch for complete while
        its calls go out; a cancel after the submitter died covers it) unless the batch is cancelled or gone
        already; False: send nothing."""
        pipe = self.conn.pipeline(transaction=False)
        pipe.hset(keys.batch(self.id), "sending", _sending_mark(end))
        pipe.hget(keys.batch(self.id), "state")  # (after the mark: a cancel after this read sees it)
        if text(pipe.execute()[1] or b"cancelled") != "cancelled":
            return True
        self.conn.hdel(keys.batch(self.id), "sending")
        self.cancelled = True
        return False

    def send(self, chunk: list[tuple[int, Any]]) -> None:
        end = chunk[-1][0] + 1
        if self.resume:
            chunk = self.unfinished(chunk)
        self.make_room(len(chunk))
        if not self.begin(end):
            return
        self.send_chunk(chunk)  # (failing, it leaves its mark: stale, its chunk then counts as sent)
        self.sent = max(self.sent, end)
        pipe = self.conn.pipeline(transaction=False)
        pipe.hset(keys.batch(self.id), "submitted", self.sent)
        pipe.hdel(keys.batch(self.id), "sending")
        pipe.expire(keys.batch(self.id), self.ttl)  # (a batch that runs longer than its TTL stays)
        pipe.execute()
        if self.is_cancelled():  # cancelled while this chunk went out: its calls go too
            self.store.cancel(self.gw, self.id)

    def send_chunk(self, chunk: list[tuple[int, Any]]) -> None:
        prepared = []
        for i, args in chunk:
            queue = self.queue_of(i)
            if args is None:  # (a JSON null item: tool_envelope would take it for no arguments)
                self.store.write_unsent(self.id, queue, i, self.ttl, InvalidArgs("the item is null, not an argument mapping"))
                continue
            opts = CallOptions(queue=keys.base_queue(queue), fairness_key=self.id, call_class="batch",
                               call_id=item_call_id(self.id, i), partition_slot=i)
            try:
                env = tool_envelope(self.entry, self.meta["tool"], args, opts, self.context, self.channel,
                                    self.gw.settings)
            except (InvalidArgs, TypeError) as e:
                err = e if isinstance(e, HermesError) else InvalidArgs(str(e))
                self.store.write_unsent(self.id, queue, i, self.ttl, err)
                continue
            extra = (keys.F_BATCH, f"{self.ttl} {i} {keys.batch_part(env.queue, self.id)}")
            prepared.append((env, {**tool_limits(env, self.entry.spec, self.gw.settings), "extra": extra}, i))
        delay = 0.02
        while prepared and (prepared := self.submit(prepared)):  # (submit returns those refused)
            if self.is_cancelled():  # those still waiting for room end cancelled, never sent
                for _, _, i in prepared:
                    self.store.write_cancelled(self.id, self.queue_of(i), i, self.ttl)
                break
            time.sleep(delay)  # the queue is full: wait for room rather than fail the item
            delay = min(0.5, delay * 2)
            self.conn.hset(keys.batch(self.id), "sending", _sending_mark(chunk[-1][0] + 1))  # (still in flight)

    def submit(self, prepared: list[Any]) -> list[Any]:
        """SUBMIT ``prepared`` in one pipeline; returns the ones refused with QueueFull. With
        ``broker.wait_replicas``, a chunk too few replicas confirmed is cancelled, as ``call_tool`` cancels
        its call, and BrokerNotDurable stops the submitter (``wait()`` raises it)."""
        replies, acked = self.gw._send_chunk(prepared)  # (as call_tool's: a moving slot is waited out)
        if acked is not None:
            what = f"batch {self.id}: {len(prepared)} call(s) not accepted"
            error = durability.shortfall(acked, self.gw.settings, what, batch_id=self.id)
            if error is not None:
                error.details["cancelled"] = sum(self.gw.cancel(env.call_id) for env, _, _ in prepared)
                raise error
        refused = []
        for item, reply in zip(prepared, replies, strict=True):
            env, limits, _ = item
            if isinstance(reply, Exception):
                raise reply if isinstance(reply, HermesError) else HermesError(f"submission failed: {reply}")
            try:
                Calls.check_submit(reply, limits["ckey"], limits["queue_size"])
            except QueueFull:
                refused.append(item)
        return refused

    def unfinished(self, chunk: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """The items of ``chunk`` with no result yet (a resumed batch sends only those)."""
        done = self.store.has_result(self.id, self.queue_of, (i for i, _ in chunk))
        return [item for item, has in zip(chunk, done, strict=True) if not has]


class BatchJob:
    """A batch seen from one process: ``gw.batch(...)`` (submitting in a thread) or ``gw.batch_job(id)``."""

    def __init__(self, gw: Gateway, batch_id: str, thread: threading.Thread | None = None) -> None:
        self.gw = gw
        self.id = batch_id
        self.store = BatchStore(gw.conn)
        self._thread = thread
        self.error: BaseException | None = None

    def progress(self) -> Progress:
        return self.store.progress(self.id)

    def results(self, follow: bool = True) -> Iterator[Item]:
        """Each item's outcome once, as the calls end, until the batch is complete."""
        yield from self.store.results(self.id, follow, lambda: self.error is not None)
        self._raise()

    def cancel(self) -> int:
        return self.store.cancel(self.gw, self.id)

    def wait(self, timeout: float | None = None) -> Progress:
        """Block until every item is sent and has ended (or ``timeout``); raises what stopped the submitter."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
        self._raise()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.store.wait(self.id, left)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


class AsyncBatchJob:
    """A :class:`BatchJob` for asyncio: the same model, its Redis reads run in worker threads."""

    def __init__(self, job: BatchJob) -> None:
        self.job = job
        self.id = job.id

    async def progress(self) -> Progress:
        return await asyncio.to_thread(self.job.progress)

    async def cancel(self) -> int:
        return await asyncio.to_thread(self.job.cancel)

    async def wait(self, timeout: float | None = None) -> Progress:
        return await asyncio.to_thread(self.job.wait, timeout)

    async def results(self, follow: bool = True) -> AsyncIterator[Item]:
        """Each item's outcome once, as the calls end (read in worker threads, ``POLL`` apart when idle)."""
        pages = self.job.store.pages(self.id, follow, lambda: self.job.error is not None)
        while (items := await asyncio.to_thread(next, pages, None)) is not None:
            for item in items:
                yield item
            if not items:
                await asyncio.sleep(POLL)
        self.job._raise()


def start(gw: Gateway, tool: str, items: Iterable[Any], *, window: int | None = None, ttl: int | None = None,
          resume: str | None = None, context: dict[str, Any] | None = None) -> BatchJob:
    """Make (or ``resume``) a batch of ``tool`` over ``items`` and send them in a thread."""
    store = BatchStore(gw.conn)
    settings = gw.settings
    if resume is not None:
        meta = store.meta(resume)
        if meta["tool"] != tool:
            raise InvalidArgs(f"batch {resume} is a batch of {meta['tool']!r}, not {tool!r}")
        now_queues = batch_queues(gw.directory.get(tool).spec, settings)
        if now_queues != meta["queues"].split(","):  # (its items' call ids and partitions would differ)
            raise InvalidArgs(
                f"batch {resume} cannot be resumed: tool {tool!r} is split over other queues now "
                f"({', '.join(now_queues)}; the batch's: {meta['queues']})", batch_id=resume,
            )
        batch_id = resume
        # (before the thread starts: a reader must not take it for complete; a cancel is never undone)
        if store.set_state(batch_id, "submitting", int(meta["ttl"]), error="") in ("cancelled", ""):
            raise InvalidArgs(f"batch {resume} was cancelled: it cannot be resumed", batch_id=resume)
    else:
        queues = batch_queues(gw.directory.get(tool).spec, settings)
        principal = (context or {}).get("principal")
        ttl, window = ttl or settings.batch.ttl, window or settings.batch.window
        batch_id = store.create(tool, queues, ttl=ttl, window=window, principal=principal)
    job = BatchJob(gw, batch_id)

    def run() -> None:
        try:
            meta = store.meta(batch_id)
            if meta.get("state") == "cancelled":
                raise HermesError(f"batch {batch_id} was cancelled", batch_id=batch_id)
            Submitter(store, gw, batch_id, meta, resume=resume is not None, context=context or {}).run(items)
            store.progress(batch_id)  # (stamps the end of a batch that is complete already)
        except BaseException as e:  # handed to wait() / results() of this job, and said in its meta
            job.error = e
            with contextlib.suppress(Exception):  # (the broker may be what failed)
                store.set_state(batch_id, "stopped", int(store.meta(batch_id)["ttl"]), error=f"{type(e).__name__}: {e}")

    job._thread = threading.Thread(target=run, name=f"hermes-batch-{batch_id}", daemon=True)
    job._thread.start()
    return job
