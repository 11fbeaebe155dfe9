"""Fleet-wide rate limits (requests and tokens per minute, requests per second) on a concurrency key.

The limiter itself is ``broker/lua/ratelimit.lua``, run inside the admission scripts. This module holds
the typed limit, the token estimate of an LLM request, and what runs beside admission: the worker's
"sent" stamp, a provider's pause (429/503), the timer and the operators' snapshot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from . import keys, pipes, scripts
from .codec import text
from .errors import InvalidSpec

KINDS = ("requests_per_minute", "tokens_per_minute", "requests_per_second")
DEFAULT_MAX_TOKENS = 1024  # an LLM request's reply estimate when it names no max_tokens
CHARS_PER_TOKEN = 4  # the prompt estimate: its JSON text's length / 4 (OpenAI's rule of thumb)


@dataclass(frozen=True)
class RateLimit:
    """``{requests_per_minute, tokens_per_minute, requests_per_second}``; -1 = no limit of that kind."""

    rpm: int = -1
    tpm: int = -1
    rps: int = -1

    @classmethod
    def parse(cls, where: str, data: Any) -> RateLimit | None:
        """The limit ``data`` says (None for an empty one); InvalidSpec names the bad field."""
        if data is None:
            return None
        if not isinstance(data, Mapping):
            raise InvalidSpec.at(where, "rate_limit", f"expected a mapping with {', '.join(KINDS)}, got {data!r}")
        values: dict[str, int] = {}
        for key, value in data.items():
            if key not in KINDS:
                raise InvalidSpec.at(where, f"rate_limit.{key}", f"unknown key; known keys: {', '.join(KINDS)}")
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise InvalidSpec.at(where, f"rate_limit.{key}", f"expected an integer >= 1, got {value!r}")
            values[key] = value
        if not values:
            return None
        return cls(*(values.get(kind, -1) for kind in KINDS))  # (KINDS is in field order)

    def share(self, n: int, i: int) -> RateLimit:
        """Partition ``i``'s part of the limit split in ``n`` (as ``keys.partition_share`` splits concurrency)."""
        share = keys.partition_share
        return RateLimit(share(self.rpm, n, i), share(self.tpm, n, i), share(self.rps, n, i))

    def argv(self) -> str:
        """The limit as SUBMIT takes it."""
        return f"{self.rpm} {self.rps} {self.tpm}"

    def to_dict(self) -> dict[str, int]:
        return {k: v for k, v in zip(KINDS, (self.rpm, self.tpm, self.rps), strict=True) if v >= 0}


def estimate_tokens(request: Mapping[str, Any], default_max: int = DEFAULT_MAX_TOKENS) -> int:
    """Tokens an LLM request may use: its ``max_completion_tokens`` / ``max_tokens`` (else ``default_max``)
    plus its messages' JSON length / 4, rounded up (the provider's reported usage settles it)."""
    reply = request.get("max_completion_tokens") or request.get("max_tokens") or default_max
    try:
        reply = max(0, int(reply))
    except (TypeError, ValueError):
        reply = default_max
    prompt = json.dumps(request.get("messages") or [], ensure_ascii=False, default=str)
    return reply + math.ceil(len(prompt) / CHARS_PER_TOKEN)


class RateLimiter:
    """The scripts beside admission: sent stamps, pauses, the timer, and the snapshot."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._sent = conn.register_script(scripts.RATE_SENT)
        self._pause = conn.register_script(scripts.RATE_PAUSE)
        self._again = conn.register_script(scripts.RATE_AGAIN)
        self._due = conn.register_script(scripts.RATE_DUE)
        self._promote = conn.register_script(scripts.RATE_PROMOTE)

    def sent(self, call_id: str, queue: str, ckey: str, slack: float = 0.0, pipeline: Any = None) -> Any:
        """Stamp the call's entry: its request left now (+ ``slack`` seconds)."""
        tag = keys.tag(queue)
        script_keys = [
            keys.rate(tag, ckey), keys.rate_log(tag, ckey), keys.rate_due(tag), keys.waiting(tag, ckey),
            keys.waiting_batch(tag, ckey),
        ]
        return pipes.script(self._sent, script_keys, [call_id, ckey, int(slack * 1000)], pipeline)

    def apply(self, spec: Any) -> None:
        """A tool spec just registered: its ``rate_limit`` (each partition's share; none: removed) goes on its
        limiters now, and their timers fire, so calls already waiting go by it (raised: they go; lowered: it
        holds at once), not only once another call is submitted."""
        limit = RateLimit.parse(f"tool {spec.name!r}", spec.config.get("rate_limit"))
        n, ckey = keys.partition_count(spec), f"tool:{spec.name}"
        tags = [keys.tag(q) for q in keys.partition_names(str(spec.config.get("queue") or "tools"), n)]
        pipe = self.conn.pipeline(transaction=False)
        for i, tag in enumerate(tags):
            if limit is None:  # (removed, if it had one: only then do its timers fire)
                pipe.hdel(keys.rate(tag, ckey), "rpm", "rps", "tpm")
            else:
                share = limit.share(n, i)
                pipe.hset(keys.rate(tag, ckey), mapping={"rpm": share.rpm, "rps": share.rps, "tpm": share.tpm})
                pipe.sadd(keys.rates(tag), ckey)
        changed = pipe.execute()
        if limit is None:
            tags = [tag for tag, removed in zip(tags, changed, strict=True) if removed]
        if tags:
            pipe = self.conn.pipeline(transaction=False)
            for tag in tags:
                pipe.zadd(keys.rate_due(tag), {ckey: 0})
            pipe.execute()

    def pause(self, call_id: str, queue: str, ckey: str, seconds: float) -> float:
        """Pause the key for the whole fleet ``seconds`` from now; returns the pause's end (unix s)."""
        tag = keys.tag(queue)
        end = self._pause(keys=[keys.rate(tag, ckey), keys.rate_log(tag, ckey)], args=[call_id, seconds])
        return int(end) / 1000.0

    def again(self, call_id: str, queue: str, ckey: str) -> float:
        """Take a new entry for the call's next request: 0 when taken, else seconds to wait before asking again."""
        tag = keys.tag(queue)
        return int(self._again(keys=[keys.rate(tag, ckey), keys.rate_log(tag, ckey), keys.rate_due(tag)],
                               args=[call_id, ckey])) / 1000.0

    def due(self, queues: Sequence[str], hold: float, wake: Mapping[str, str]) -> tuple[int, float | None]:
        """Promote the waiting calls of every key whose limiter has room again on ``queues``; returns
        (keys promoted, when the next timer fires, unix s). ``wake``: queue -> its wake channel."""
        done = 0
        nxt: float | None = None
        for q in queues:
            tag = keys.tag(q)
            reply = self._due(keys=[keys.rate_due(tag)], args=[int(hold * 1000), 100])
            after = reply.pop()
            for raw in reply:
                ckey = text(raw)
                self._promote(
                    keys=[
                        keys.rate_due(tag),
                        keys.slots(tag, ckey),
                        keys.waiting(tag, ckey),
                        keys.limits(tag),
                        keys.queue(q),
                        keys.rate(tag, ckey),
                        keys.rate_log(tag, ckey),
                        keys.waiting_batch(tag, ckey),
                        keys.fair(tag, ckey),
                    ],
                    args=[ckey, wake[q], keys.job("")],
                )
                done += 1
            if after not in (b"", "", None):
                at = float(after) / 1000.0
                nxt = at if nxt is None else min(nxt, at)
        return done, nxt

    def snapshot(self, queues: Sequence[str]) -> list[dict[str, Any]]:
        """Every limiter on ``queues``: its limits, what is left in the window, calls waiting, its pause."""
        now_s, now_us = self.conn.time()
        now = now_s * 1000 + now_us // 1000
        rows: dict[str, dict[str, Any]] = {}
        for q in queues:
            tag = keys.tag(q)
            for raw in sorted(self.conn.smembers(keys.rates(tag))):
                ckey = text(raw)
                cfg = self.conn.hmget(keys.rate(tag, ckey), "rpm", "rps", "tpm", "sum", "pause")
                if all(v is None for v in cfg[:3]):
                    continue
                rpm, rps, tpm, tok, pause = (int(v) if v is not None else None for v in cfg)
                log = keys.rate_log(tag, ckey)
                pipe = self.conn.pipeline(transaction=False)
                pipe.zcount(log, f"({now - 60000}", "+inf")
                pipe.zcount(log, f"({now - 1000}", "+inf")
                pipe.zcard(keys.waiting(tag, ckey))
                pipe.zcard(keys.waiting_batch(tag, ckey))
                in_min, in_sec, waiting, waiting_batch = pipe.execute()
                row = rows.setdefault(ckey, {"key": ckey, "limits": {}, "left": {}, "waiting": 0, "paused_until": None})
                for name, limit, used in (
                    ("requests_per_minute", rpm, in_min),
                    ("requests_per_second", rps, in_sec),
                    ("tokens_per_minute", tpm, tok or 0),
                ):
                    if limit is not None and limit >= 0:
                        row["limits"][name] = row["limits"].get(name, 0) + limit
                        row["left"][name] = row["left"].get(name, 0) + max(0, limit - int(used))
                row["waiting"] += int(waiting) + int(waiting_batch)
                if pause and pause > now:
                    row["paused_until"] = max(row["paused_until"] or 0, pause / 1000.0)
        return [rows[k] for k in sorted(rows)]
