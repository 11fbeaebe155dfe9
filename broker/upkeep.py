"""Lua scripts that put calls and slots back: expired leases (REAP), slots of ended calls (SWEEP), retries
that are due (DUE), a leased call never started (REQUEUE).

The call's own way through (submit, claim, transition) is in ``broker.scripts``.
"""

from __future__ import annotations

from .scripts import SLOTS

# The entries of the zset KEYS[1] due by ARGV[1] (at most ARGV[3]) whose record's first field passes
# ``keep``: held until ARGV[2] (so one caller owns them) and returned as {id, fields..., ...}; the others
# leave the set.
_TAKE_DUE = r"""
local function take_due(fields, keep)
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
  local out = {}
  for _, id in ipairs(ids) do
    local f = redis.call('HMGET', 'rq:job:' .. id, unpack(fields))
    if keep(f[1]) then
      redis.call('ZADD', KEYS[1], ARGV[2], id)
      out[#out + 1] = id
      for i = 1, #fields do out[#out + 1] = f[i] or '' end
    else
      redis.call('ZREM', KEYS[1], id)
    end
  end
  return out
end
"""

# KEYS: 1 leases. ARGV: 1 now, 2 reaper lease deadline, 3 limit.
# Takes expired leases over (pushes their deadline out so one reaper owns them) and returns
# {call_id, state, attempt, max_attempts, queue, cancel, ckey, ...} for the reaper to settle.
REAP = (
    _TAKE_DUE
    + r"""
return take_due({'h_state', 'h_attempt', 'h_max_attempts', 'h_queue', 'h_cancel', 'h_ckey'},
                function(state) return state end)  -- a record that is gone just leaves the set
"""
)

# KEYS: 1 limits hash. ARGV: 1 cut-off (slots whose deadline is older are checked), 2 max per key,
# 3 wake channel suffix.
# Frees slots still held by calls that ended, went back to retrying, or vanished (a safety net: every
# path that ends a call releases its slot in the same script), then refills. Returns slots freed.
SWEEP = (
    SLOTS
    + r"""
local freed = 0
for _, ckey in ipairs(redis.call('HKEYS', KEYS[1])) do
  local slots, waiting = 'hermes:slots:' .. ckey, 'hermes:waiting:' .. ckey
  local stale = redis.call('ZRANGEBYSCORE', slots, '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
  local n = 0
  for _, id in ipairs(stale) do
    local st = redis.call('HGET', 'rq:job:' .. id, 'h_state')
    if not st or st == 'done' or st == 'failed' or st == 'cancelled' or st == 'retrying' then
      redis.call('ZREM', slots, id)
      n = n + 1
    end
  end
  if n > 0 then promote(slots, waiting, KEYS[1], ckey, ARGV[3]) end
  if redis.call('EXISTS', slots) == 0 and redis.call('EXISTS', waiting) == 0 then
    redis.call('HDEL', KEYS[1], ckey)
  end
  freed = freed + n
end
return freed
"""
)

# KEYS: 1 scheduled zset. ARGV: 1 now, 2 hold until, 3 max.
# Retries that are due, held for a while by this scheduler (a dead one's become due again), with what
# a transition needs: {call_id, state, attempt, trace, kind, tool, channel, ckey, origin, queue, ...};
# the last element is the next due time after them ('' when none).
DUE = (
    _TAKE_DUE
    + r"""
local out = take_due({'h_state', 'h_attempt', 'h_trace', 'h_kind', 'h_tool', 'h_channel', 'h_ckey', 'origin', 'h_queue'},
                     function(state) return state == 'retrying' end)
local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
out[#out + 1] = nxt[2] or ''
return out
"""
)

# KEYS: 1 leases, 2 slots zset of its key, 3 its queue. ARGV: 1 call id, 2 wake channel.
# A call leased but never started that still holds its slot and is ``pending``: back at the head of its
# queue, unleased, keeping the slot. Returns 1, or 0 when it did not qualify (nothing done).
REQUEUE = r"""
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) or redis.call('HGET', 'rq:job:' .. ARGV[1], 'h_state') ~= 'pending' then
  return 0
end
redis.call('ZADD', KEYS[2], 'inf', ARGV[1])
redis.call('LPUSH', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[2], '')
return 1
"""
