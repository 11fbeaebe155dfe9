"""Lua scripts of a call's way through: submit, claim, transition. Each check-then-set is one atomic script.

Events are msgpack maps; a script appends ``seq`` to the map it is given, so the sequence number is
assigned atomically with the state change and the history append, with no msgpack library in Lua.
The scripts that put calls and slots back (reaping, sweeping, due retries) are in
``broker.upkeep``.
"""

from __future__ import annotations

# Appends the key "seq" with integer value `seq` to the fixmap `p` (at most 14 entries).
_WITH_SEQ = r"""
local function with_seq(p, seq)
  local n = string.byte(p, 1) - 128
  local s
  if seq < 128 then
    s = string.char(seq)
  elseif seq < 65536 then
    s = string.char(205, math.floor(seq / 256), seq % 256)
  else
    s = string.char(206, math.floor(seq / 16777216) % 256, math.floor(seq / 65536) % 256,
                    math.floor(seq / 256) % 256, seq % 256)
  end
  return string.char(128 + n + 1) .. string.sub(p, 2) .. '\163seq' .. s
end
"""

# Concurrency slots. A call is *waiting* (zset by submit time, bounded by queue_size) until it can take
# a slot of its concurrency key; it then holds the slot (score +inf while queued, its lease deadline once
# claimed) until it ends or goes back to ``retrying``. Only calls holding a slot are on an RQ queue, so
# a worker never blocks on a limit. Every push onto a queue publishes the queue's wake-up channel.
# (Lua helpers: wake, limit_of, promote, admit; shared with ``broker.upkeep``.)
SLOTS = r"""
local function wake(qkey, suffix)
  redis.call('PUBLISH', 'hermes:wake:' .. string.sub(qkey, 10) .. suffix, '')
end
local function limit_of(limits, ckey)
  return tonumber(redis.call('HGET', limits, ckey) or '-1')
end
-- Fill free slots with the oldest waiting calls, pushing each onto its queue (``known``: the key's limit,
-- when the caller has read it already).
local function promote(slots, waiting, limits, ckey, suffix, known)
  local limit = known or limit_of(limits, ckey)
  while limit < 0 or redis.call('ZCARD', slots) < limit do
    local top = redis.call('ZPOPMIN', waiting)
    if #top == 0 then break end
    local id = top[1]
    local f = redis.call('HMGET', 'rq:job:' .. id, 'h_state', 'h_queue')
    if f[1] == 'pending' and f[2] then
      redis.call('ZADD', slots, 'inf', id)
      redis.call('RPUSH', f[2], id)
      wake(f[2], suffix)
    end
  end
end
-- Admit a call that is already accepted: a free slot when nobody waits before it, else wait.
local function admit(slots, waiting, limits, ckey, id, qkey, score, suffix)
  local limit = limit_of(limits, ckey)
  if redis.call('ZCARD', waiting) == 0 and (limit < 0 or redis.call('ZCARD', slots) < limit) then
    redis.call('ZADD', slots, 'inf', id)
    redis.call('RPUSH', qkey, id)
    wake(qkey, suffix)
  else
    redis.call('ZADD', waiting, score, id)
    promote(slots, waiting, limits, ckey, suffix)
  end
end
"""

# KEYS: 1 call hash, 2 history, 3 leases, 4 waiting zset, 5 slots zset (of the call's concurrency key),
#       6 limits hash, 7 scheduled zset
# ARGV: 1 call_id, 2 event payload, 3 ttl, 4 attempt fence, 5 allowed sources, 6 new state, 7 rq status,
#       8 lease, 9 requeue queue key, 10 waiting score, 11 channel, 12 release the slot, 13 concurrency key,
#       14 due time of a retry, 15 wake suffix, 16 k earlier events, 17..16+k their payloads, then fields
# Returns {seq, state before}; seq < 0: -1 no such call, -2 attempt fence, -3 wrong source state.
TRANSITION = (
    _WITH_SEQ
    + SLOTS
    + r"""
local rec = redis.call('HMGET', KEYS[1], 'h_state', 'h_attempt', 'h_queue', 'h_idem')
local st = rec[1]
if not st then return {-1, ''} end
if ARGV[4] ~= '' and rec[2] ~= ARGV[4] then return {-2, st} end
if ARGV[5] == '' then
  if st == 'done' or st == 'failed' or st == 'cancelled' then return {-3, st} end
elseif ARGV[5] == 'pending!' then  -- pending and taken by no worker (a caller cancelling it directly)
  if st ~= 'pending' or redis.call('ZSCORE', KEYS[3], ARGV[1]) then return {-3, st} end
elseif ARGV[5] ~= '*' then
  if not string.find(',' .. ARGV[5] .. ',', ',' .. st .. ',', 1, true) then return {-3, st} end
end
local before = tonumber(ARGV[16])
-- One increment for every event this call records: the earlier ones get seq .. seq + before - 1.
local seq = redis.call('HINCRBY', KEYS[1], 'h_seq', before + 1) - before
-- The new state and the record's fields in one write.
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'h_state', ARGV[6], 'status', ARGV[7], unpack(ARGV, 17 + before, #ARGV))
elseif #ARGV >= 17 + before then
  redis.call('HSET', KEYS[1], unpack(ARGV, 17 + before, #ARGV))
end
if ARGV[8] == '-' then
  redis.call('ZREM', KEYS[3], ARGV[1])
elseif ARGV[8] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[8], ARGV[1])
end
if ARGV[12] == '1' then
  redis.call('ZREM', KEYS[4], ARGV[1])
  if redis.call('ZREM', KEYS[5], ARGV[1]) == 1 then
    promote(KEYS[5], KEYS[4], KEYS[6], ARGV[13], ARGV[15])
  end
end
if ARGV[14] ~= '' then
  redis.call('ZADD', KEYS[7], ARGV[14], ARGV[1])
end
if ARGV[9] ~= '' then
  redis.call('ZREM', KEYS[7], ARGV[1])
  admit(KEYS[5], KEYS[4], KEYS[6], ARGV[13], ARGV[1], ARGV[9], ARGV[10], ARGV[15])
end
-- Every event in order: one append to the history, one message each on the caller's channel.
local stored = {}
for i = 17, 16 + before do
  local early = with_seq(ARGV[i], seq)
  stored[#stored + 1] = early
  redis.call('PUBLISH', ARGV[11], early)
  seq = seq + 1
end
local ev = with_seq(ARGV[2], seq)
stored[#stored + 1] = ev
redis.call('RPUSH', KEYS[2], unpack(stored))
if ARGV[3] ~= '' then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  -- An idempotency key lives no longer than the record it names.
  if rec[4] and redis.call('GET', rec[4]) == ARGV[1] then redis.call('EXPIRE', rec[4], ARGV[3]) end
end
redis.call('PUBLISH', ARGV[11], ev)
return {seq, st}
"""
)

# KEYS: 1 call hash, 2 queue list, 3 history, 4 waiting zset, 5 rq:queues, 6 idempotency key,
#       7 slots zset, 8 limits hash
# ARGV: 1 call_id, 2 pending event payload, 3 ttl, 4 queue_size (-1 = unlimited), 5 waiting score,
#       6 channel, 7 queue key, 8 digest of the request under the idempotency key ('' = no key),
#       9 concurrency (-1 = unlimited), 10 concurrency key, 11 wake channel suffix, 12.. field/value
#       pairs of the job hash (with an idempotency key: ``h_idem`` its key, ``h_digest`` ARGV[8])
# Returns {1, call_id, queued 1 / waiting 0} accepted; {0, existing call_id[, its tool, its kind]}
# duplicate; {-1, depth} queue full (depth = calls waiting for a slot of this key); {-2, existing call_id, its tool, its kind} the key belongs to a call with another digest.
# An idempotency key names a call only while that call's record exists: TRANSITION gives the key the
# record's TTL when it ends, and a key found without its record (written by an older version) is ignored.
# A record with no ``h_digest`` (an older version's) matches any digest: the caller compares tool and kind.
SUBMIT = (
    _WITH_SEQ
    + SLOTS
    + r"""
if ARGV[8] ~= '' then
  local existing = redis.call('GET', KEYS[6])
  if existing then
    local f = redis.call('HMGET', 'rq:job:' .. existing, 'h_tool', 'h_kind', 'h_digest')
    if f[1] then
      if f[3] and f[3] ~= ARGV[8] then return {-2, existing, f[1], f[2] or ''} end
      return {0, existing, f[1], f[2] or ''}
    end
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, ARGV[1]} end
local limit = tonumber(ARGV[9])
redis.call('HSET', KEYS[8], ARGV[10], ARGV[9])
local depth = redis.call('ZCARD', KEYS[4])
local run = depth == 0 and (limit < 0 or redis.call('ZCARD', KEYS[7]) < limit)
if not run then
  local qsize = tonumber(ARGV[4])
    if qsize >= 0 and depth >= qsize then return {-1, depth} end
end
redis.call('HSET', KEYS[1], 'h_seq', '1', 'h_state', 'pending', 'status', 'queued', unpack(ARGV, 12))
if run then
  redis.call('ZADD', KEYS[7], 'inf', ARGV[1])
  redis.call('RPUSH', KEYS[2], ARGV[1])
else
  redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1])
  promote(KEYS[7], KEYS[4], KEYS[8], ARGV[10], ARGV[11])  -- slots free after the limit was raised
end
redis.call('SADD', KEYS[5], ARGV[7])
if ARGV[8] ~= '' then redis.call('SET', KEYS[6], ARGV[1], 'EX', ARGV[3]) end
local ev = with_seq(ARGV[2], 1)
redis.call('RPUSH', KEYS[3], ev)
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
redis.call('PUBLISH', ARGV[6], ev)
return {1, ARGV[1], run and 1 or 0}
"""
)

# KEYS: 1 leases, 2.. queue lists (in priority order)
# ARGV: 1 max calls, 2 worker name, 3 lease deadline, 4 started_at (RQ time format)
# Pops up to ARGV[1] pending calls, leases them to this worker (their slot's score becomes the lease
# deadline), and returns {call_id, data, attempt, ...}. Calls no longer pending (cancelled, expired)
# are dropped from the queue; their slot went back when they ended.
CLAIM = r"""
local out = {}
local want = tonumber(ARGV[1])
local got = 0
for q = 2, #KEYS do
  while got < want do
    local id = redis.call('LPOP', KEYS[q])
    if not id then break end
    local hk = 'rq:job:' .. id
    local f = redis.call('HMGET', hk, 'h_state', 'h_ckey', 'data', 'h_attempt')
    if f[1] == 'pending' then
      if f[2] then redis.call('ZADD', 'hermes:slots:' .. f[2], 'XX', ARGV[3], id) end
      redis.call('HSET', hk, 'h_worker', ARGV[2], 'worker_name', ARGV[2], 'started_at', ARGV[4])
      redis.call('ZADD', KEYS[1], ARGV[3], id)
      out[#out + 1] = id
      out[#out + 1] = f[3]
      out[#out + 1] = f[4]
      got = got + 1
    end
  end
end
return out
"""
