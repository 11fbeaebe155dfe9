"""Submitting calls: the SUBMIT script (admission, idempotency, the ``pending`` event) and its reply.

``broker.calls.Calls`` adds transitions on top.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
from redis.client import Pipeline

from . import events, keys, pipes, scripts
from .claims import Claims
from .codec import text
from .connection import is_cluster
from .envelope import Envelope, fairness_of
from .errors import QueueFull
from .idempotency import conflict, request_digest
from .ratelimits import RateLimit
from .records import CallInfo, job_fields, waiting_score
from .settings import DEFAULT_BATCH_SHARE
from .states import State

SUBMIT_TTL = 7 * 86400

# Job hash fields of a call submitted under an idempotency key: the key (TRANSITION gives it the record's
# TTL when the call ends) and the digest of what was asked (a resubmission asking otherwise is a conflict).
F_IDEM = "h_idem"
F_DIGEST = "h_digest"

# Fair dispatch (broker/lua/slots.lua): a weight-1 fairness key's step between its waiting calls' tags
# (the tag step of weight w is UNIT / w, an integer: the waiting sets keep integer scores), and the scale
# of the batch share passed to the scripts (per 10,000).
UNIT = 1_000_000
SHARE_SCALE = 10_000


class Submits(Claims):
    """Submission of calls."""

    def __init__(self, conn: redis.Redis) -> None:
        super().__init__(conn)
        self._submit = conn.register_script(scripts.SUBMIT)
        # Events go out on sharded channels (in the call's slot) on a cluster, where plain PUBLISH would
        # reach every node; a plain Redis (the embedded one may be 6.2) has only PUBLISH.
        self.publish = "SPUBLISH" if is_cluster(conn) else "PUBLISH"
        self.listed: set[str] = set()  # queues this process added to rq:queues
        self.is_async = isinstance(conn, (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster))

    def list_queue(self, queue: str) -> None:
        """Add ``queue`` to RQ's set of queues (``rq info`` lists it), once per process: a set spanning
        queues is no key of a submission's slot."""
        if queue not in self.listed:
            self.conn.sadd(keys.RQ_QUEUES, keys.queue(queue))
            self.listed.add(queue)

    # -- submission ------------------------------------------------------------------------------

    def submit(
        self,
        env: Envelope,
        *,
        ckey: str,
        queue_size: int,
        max_attempts: int,
        timeout: float,
        concurrency: int = -1,
        weight: float = 1.0,
        batch_share: float = DEFAULT_BATCH_SHARE,
        key_size: int = -1,
        rate_limit: RateLimit | None = None,
        estimate: int = 0,
        pipeline: Pipeline | None = None,
        extra: tuple[Any, ...] = (),
    ) -> Any:
        """Admit a call with its ``pending`` event: onto its queue with a slot of ``ckey`` when one is free
        (``concurrency`` -1 = no limit) and its ``rate_limit`` allows it (``estimate`` tokens reserved),
        else waiting (at most ``queue_size``; at most ``key_size`` of its fairness key and class, -1 = no
        such bound) for its fair turn (``weight`` of its fairness key; ``batch_share``: the least share of
        promotions batch calls get). Returns the script's reply.
        ``extra``: more field/value pairs for the job hash (a batch's call: ``h_batch``)."""
        info = CallInfo.of(env, ckey)
        ev = events.payload(
            call_id=env.call_id,
            state=State.PENDING,
            trace_id=info.trace_id,
            span_id=info.span_id,
            attempt=1,
            kind=env.kind,
            name=info.name,
            session_id=info.session_id,
            detail={"queue": env.queue},
        )
        fields = job_fields(env, ckey=ckey, max_attempts=max_attempts, timeout=timeout)
        fkey, klass = fairness_of(env)
        flat = [x for k, v in fields.items() for x in (k, "" if v is None else v)]
        idem = env.options.idempotency_key
        digest = ""
        tag = keys.tag(env.queue)
        if idem:
            digest = request_digest(env)
            flat += [F_IDEM, keys.idempotency(tag, idem), F_DIGEST, digest]
        flat += extra
        if not self.is_async:  # (an asyncio client awaits its own SADD: AsyncGateway._list)
            self.list_queue(env.queue)
        return pipes.script(
            self._submit,
            [
                keys.job(env.call_id),
                keys.queue(env.queue),
                keys.history(env.call_id),
                keys.waiting(tag, ckey),
                keys.idempotency(tag, idem or ""),
                keys.slots(tag, ckey),
                keys.limits(tag),
                keys.waiting_batch(tag, ckey),
                keys.fair(tag, ckey),
                keys.rate(tag, ckey),
                keys.rate_log(tag, ckey),
                keys.rate_due(tag),
                keys.rates(tag),
            ],
            [
                env.call_id,
                ev,
                SUBMIT_TTL,
                queue_size,
                waiting_score(),
                env.channel,
                digest,
                concurrency,
                ckey,
                self.wake_channel(env.queue),
                self.publish,
                keys.job(""),
                fkey,
                klass,
                max(1, round(UNIT / weight)),
                round(batch_share * SHARE_SCALE),
                key_size,
                rate_limit.argv() if rate_limit is not None else "",
                estimate if rate_limit is not None else 0,
                *flat,
            ],
            pipeline,
        )

    @staticmethod
    def check_submit(reply: Any, ckey: str, queue_size: int, env: Envelope | None = None) -> tuple[bool, str]:
        """Turn a SUBMIT reply into (accepted_new, call_id) or raise QueueFull / IdempotencyConflict.

        With ``env`` (the envelope submitted), an existing call of another tool or kind under the same
        idempotency key is a conflict too (a record of an older version carries no digest to compare).
        """
        code, value = int(reply[0]), reply[1]
        if code == -3:
            fkey = text(reply[3])
            raise QueueFull(
                f"queue for {ckey!r} is full for fairness key {fkey!r} ({int(value)} waiting, "
                f"limit {int(reply[2])} per key: fairness.queue_size_per_key)",
                key=ckey,
                fairness_key=fkey,
                limit=int(reply[2]),
                depth=int(value),
            )
        if code == -1:
            raise QueueFull(
                f"queue for {ckey!r} is full ({int(value)} waiting, limit {queue_size})",
                key=ckey,
                limit=queue_size,
                depth=int(value),
            )
        existing = Submits.existing_call(reply)
        if code == -2 or (
            code == 0 and env is not None and existing is not None and existing != (env.name, env.kind)
        ):
            name, kind = existing or ("", "")
            raise conflict(env, text(value), name, kind)
        return code == 1, text(value)

    @staticmethod
    def existing_call(reply: Any) -> tuple[str, str] | None:
        """(tool or model, kind) of the existing call an idempotent SUBMIT reply names, if it says."""
        if int(reply[0]) in (0, -2) and len(reply) >= 4:
            return text(reply[2]), text(reply[3])
        return None
