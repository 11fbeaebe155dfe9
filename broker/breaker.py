"""Circuit breakers shared by every worker: state in one Redis hash per key, every change one Lua script.

``closed`` lets calls through and counts failures (consecutive, and/or an error rate over a window with a
minimum of calls); past the threshold it turns ``open``: calls fail at once with ``circuit_open``. After
the cooldown the first caller turns it ``half_open`` and is its only probe; the probe's outcome closes it
or opens it again. A probe whose worker died is replaced once its deadline passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline

from . import keys
from .codec import pack

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
BUCKETS = 10  # the error-rate window is counted in this many buckets

# KEYS: 1 breaker hash, 2 breakers set. ARGV: 1 now, 2 cooldown, 3 call_id, 4 probe deadline, 5 key.
# Returns {decision allow|probe|reject, state before, retry_at or ''}.
CHECK = r"""
local f = redis.call('HMGET', KEYS[1], 'state', 'opened_at', 'probe', 'probe_until')
local state = f[1] or 'closed'
if state == 'closed' then return {'allow', 'closed', ''} end
local now = tonumber(ARGV[1])
if state == 'open' then
  local reopen = tonumber(f[2] or 0) + tonumber(ARGV[2])
  if now < reopen then return {'reject', 'open', tostring(reopen)} end
  redis.call('HSET', KEYS[1], 'state', 'half_open', 'probe', ARGV[3], 'probe_until', ARGV[4], 'changed_at', now)
  redis.call('SADD', KEYS[2], ARGV[5])
  return {'probe', 'open', ''}
end
if f[3] == ARGV[3] then return {'probe', 'half_open', ''} end
if tonumber(f[4] or 0) < now then
  redis.call('HSET', KEYS[1], 'probe', ARGV[3], 'probe_until', ARGV[4])
  return {'probe', 'half_open', ''}
end
return {'reject', 'half_open', f[4] or ''}
"""

# KEYS: 1 breaker hash, 2 window hash, 3 breakers set.
# ARGV: 1 now, 2 outcome ok|fail|neutral, 3 call_id, 4 consecutive failures that open it (0 = rule off),
#       5 failure rate that opens it (0 = rule off), 6 window seconds, 7 min calls in the window,
#       8 error type, 9 key
# Returns {state after, state before, reason}.
RECORD = r"""
local f = redis.call('HMGET', KEYS[1], 'state', 'probe')
local state = f[1] or 'closed'
local now = tonumber(ARGV[1])
local outcome = ARGV[2]
local function open(reason)
  redis.call('HSET', KEYS[1], 'state', 'open', 'opened_at', now, 'changed_at', now, 'failures', 0,
             'probe', '', 'probe_until', 0, 'reason', reason, 'last_error', ARGV[8])
  redis.call('DEL', KEYS[2])
  redis.call('SADD', KEYS[3], ARGV[9])
end
if state == 'half_open' then
  if f[2] ~= ARGV[3] then return {state, state, ''} end
  if outcome == 'ok' then
    redis.call('HSET', KEYS[1], 'state', 'closed', 'changed_at', now, 'failures', 0, 'probe', '',
               'probe_until', 0, 'reason', 'probe succeeded')
    redis.call('DEL', KEYS[2])
    return {'closed', 'half_open', 'probe succeeded'}
  elseif outcome == 'fail' then
    open('probe failed')
    return {'open', 'half_open', 'probe failed'}
  end
  redis.call('HSET', KEYS[1], 'probe', '', 'probe_until', 0)
  return {'half_open', 'half_open', ''}
end
if state == 'open' or outcome == 'neutral' then return {state, state, ''} end
local reason = ''
local threshold = tonumber(ARGV[4])
if outcome == 'ok' then
  if threshold > 0 then redis.call('HSET', KEYS[1], 'failures', 0) end
else
  local n = redis.call('HINCRBY', KEYS[1], 'failures', 1)
  redis.call('HSET', KEYS[1], 'last_error', ARGV[8])
  if threshold > 0 and n >= threshold then reason = n .. ' consecutive failures' end
end
local rate = tonumber(ARGV[5])
if rate > 0 then
  local window = tonumber(ARGV[6])
  local width = window / 10
  local b = math.floor(now / width)
  redis.call('HINCRBY', KEYS[2], 'c' .. b, 1)
  if outcome == 'fail' then redis.call('HINCRBY', KEYS[2], 'f' .. b, 1) end
  redis.call('EXPIRE', KEYS[2], math.ceil(window + width))
  local calls, fails = 0, 0
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    local kind, at = string.sub(all[i], 1, 1), tonumber(string.sub(all[i], 2))
    if at <= b - 10 then
      redis.call('HDEL', KEYS[2], all[i])
    elseif kind == 'c' then
      calls = calls + tonumber(all[i + 1])
    else
      fails = fails + tonumber(all[i + 1])
    end
  end
  if reason == '' and calls >= tonumber(ARGV[7]) and fails / calls >= rate then
    reason = fails .. ' of ' .. calls .. ' calls failed in ' .. ARGV[6] .. 's'
  end
end
if reason ~= '' then
  open(reason)
  return {'open', 'closed', reason}
end
return {'closed', 'closed', ''}
"""

# Error types that count as a failure of the back end unless a breaker lists its own (``on``).
COUNTED = frozenset(
    {"executor_error", "tool_timeout", "provider_error", "provider_timeout", "internal_error"}
)


@dataclass(frozen=True)
class BreakerConfig:
    """A breaker's rules: ``breaker: {failures, cooldown, rate, window, min_calls, key, on}``."""

    key: str
    failures: int = 5
    cooldown: float = 30.0
    rate: float = 0.0
    window: float = 60.0
    min_calls: int = 20
    on: frozenset[str] = COUNTED

    @classmethod
    def of(cls, cfg: dict[str, Any], default_key: str) -> BreakerConfig:
        on = cfg.get("on")
        return cls(
            key=str(cfg.get("key") or default_key),
            # With only the error-rate rule written, the consecutive rule stays off.
            failures=int(cfg.get("failures", 0 if "rate" in cfg else 5)),
            cooldown=float(cfg.get("cooldown", 30.0)),
            rate=float(cfg.get("rate", 0.0)),
            window=float(cfg.get("window", 60.0)),
            min_calls=int(cfg.get("min_calls", 20)),
            on=frozenset([on] if isinstance(on, str) else on) if on is not None else COUNTED,
        )

    def counts(self, error_type: str) -> bool:
        """Whether an error of this type is a failure of the back end (timeouts, 5xx), not the caller's."""
        return error_type in self.on


@dataclass(frozen=True)
class Change:
    """One state change of one breaker."""

    key: str
    previous: str
    state: str
    reason: str
    call_id: str
    ts: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "previous": self.previous,
            "state": self.state,
            "reason": self.reason,
            "call_id": self.call_id,
            "ts": self.ts,
        }


@dataclass(frozen=True)
class Decision:
    """What a breaker said to one call: go (``probe`` when it is the half-open probe) or fail at once."""

    allowed: bool
    probe: bool
    retry_at: float | None
    change: Change | None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Breakers:
    """Scripted operations on circuit breakers."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._check = conn.register_script(CHECK)
        self._record = conn.register_script(RECORD)
        self.channel = keys.channel(conn, keys.BREAKER_CHANNEL)

    def check(self, cfg: BreakerConfig, call_id: str, probe_ttl: float) -> Decision:
        """May this call go to the back end? The first call after the cooldown becomes the probe."""
        now = time.time()
        decision, before, retry_at = (
            _s(v)
            for v in self._check(
                keys=[keys.breaker(cfg.key), keys.BREAKERS],
                args=[now, cfg.cooldown, call_id, now + probe_ttl, cfg.key],
            )
        )
        change = None
        if decision == "probe" and before == OPEN:
            change = Change(cfg.key, OPEN, HALF_OPEN, "cooldown over: one probe call", call_id, now)
        return Decision(
            decision != "reject", decision == "probe", float(retry_at) if retry_at else None, change
        )

    def record(self, cfg: BreakerConfig, call_id: str, outcome: str, error_type: str = "") -> Change | None:
        """Count one outcome (``ok``, ``fail`` or ``neutral``); returns the change it caused, if any."""
        now = time.time()
        after, before, reason = (
            _s(v)
            for v in self._record(
                keys=[keys.breaker(cfg.key), keys.BREAKER_WINDOW.format(cfg.key), keys.BREAKERS],
                args=[
                    now,
                    outcome,
                    call_id,
                    cfg.failures,
                    cfg.rate,
                    cfg.window,
                    cfg.min_calls,
                    error_type,
                    cfg.key,
                ],
            )
        )
        if after == before:
            return None
        return Change(cfg.key, before, after, reason, call_id, now)

    def publish(self, change: Change, pipeline: Pipeline | None = None) -> None:
        """Announce a change on the breaker channel."""
        (pipeline if pipeline is not None else self.conn).publish(self.channel, pack(change.to_dict()))

    def state(self, key: str) -> dict[str, Any]:
        """One breaker's state (``closed`` when it never tripped)."""
        raw = {_s(k): _s(v) for k, v in self.conn.hgetall(keys.breaker(key)).items()}
        return _view(key, raw)

    def all(self) -> list[dict[str, Any]]:
        """Every breaker that ever changed state, with its current state."""
        names = sorted(_s(k) for k in self.conn.smembers(keys.BREAKERS))
        pipe = self.conn.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(keys.breaker(name))
        return [
            _view(name, {_s(k): _s(v) for k, v in raw.items()})
            for name, raw in zip(names, pipe.execute(), strict=True)
        ]

    def reset(self, key: str) -> None:
        """Forget a breaker (closed again, counters cleared)."""
        self.conn.delete(keys.breaker(key), keys.BREAKER_WINDOW.format(key))
        self.conn.srem(keys.BREAKERS, key)


def _view(key: str, raw: dict[str, str]) -> dict[str, Any]:
    state = raw.get("state") or CLOSED
    out: dict[str, Any] = {
        "key": key,
        "state": state,
        "failures": int(raw.get("failures") or 0),
        "reason": raw.get("reason") or "",
        "last_error": raw.get("last_error") or "",
        "changed_at": float(raw.get("changed_at") or 0) or None,
    }
    if state == OPEN:
        out["opened_at"] = float(raw.get("opened_at") or 0)
    if state == HALF_OPEN:
        out["probe"] = raw.get("probe") or None
    return out


def rejecting(view: dict[str, Any], cooldown: float, now: float | None = None) -> bool:
    """Whether a breaker in this state would refuse a call now (open, cooldown not over)."""
    if view.get("state") != OPEN:
        return False
    return (time.time() if now is None else now) < float(view.get("opened_at") or 0) + cooldown
