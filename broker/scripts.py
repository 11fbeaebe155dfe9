"""Lua scripts of a call's way through: submit, claim, transition. Each check-then-set is one atomic script.

Events are msgpack maps; a script appends ``seq`` to the map it is given, so the sequence number is
assigned atomically with the state change and the history append, with no msgpack library in Lua.
The scripts that put calls and slots back (reaping, sweeping, due retries, spares) are in
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
#       6 limits hash, 7 scheduled zset, 8 spared zset (of the key)
# ARGV: 1 call_id, 2 event payload, 3 ttl ('' = leave; the call's idempotency key, field ``h_idem``, gets it
#       too while it still names this call), 4 attempt fence ('' = none),
#       5 allowed sources ('' = any non-terminal, '*' = anything, 'pending!' = pending and not leased),
#       6 new state ('' = no change),
#       7 rq status, 8 lease ('' keep, '-' drop, else new deadline), 9 requeue: queue key or '',
#       10 waiting score for a requeue, 11 channel, 12 release the slot ('1'/''), 13 concurrency key,
#       14 due time to schedule a retry at ('' = none), 15 wake channel suffix, 16 hand-off worker ('' =
#       none), 17 its lease deadline, 18 started_at (RQ time format), 19 the worker's spare call
#       that already runs on the released slot ('' = none), 20 spares wanted ('' = 0), 21 k: how many
#       earlier events come first, 22..21+k their payloads (moves the call made since its last write,
#       recorded and published in order before ARGV[2]), then field/value pairs
# Returns {seq, state before}; seq < 0: -1 no such call, -2 attempt fence, -3 wrong source state.
# With a hand-off worker, the slot released here goes to that worker's spare (ARGV[19]), which it has
# already started, else to its oldest spare (older than every waiting call; it may not have the reply
# that leased it yet), else to the oldest waiting call of the same queue, leased to that worker as CLAIM
# would: no queue push, no wake-up, no claim round trip between one call ending and the next one
# starting. The reply is then {seq, state before, handed call_id, data, attempt ('' where none), 1/0 the
# named spare took the slot, then call_id, data, attempt, waiting score of each spare}: the wanted spares are the oldest waiting calls of
# the queue after that, leased to the worker without a slot (``h_spare`` = waiting score) for its next
# ending calls.
TRANSITION = (
    _WITH_SEQ
    + SLOTS
    + r"""
-- The oldest waiting call, pending, of this queue: {id, its waiting score, its job fields (state, queue,
-- data, attempt)}, dropping on the way calls no longer pending (as promote() does); nil when none waits or
-- the oldest is on a queue this worker may not serve (promote() pushes that one).
local function oldest(waiting, qkey)
  while true do
    local top = redis.call('ZRANGE', waiting, 0, 0, 'WITHSCORES')
    if #top == 0 then return nil end
    local f = redis.call('HMGET', 'rq:job:' .. top[1], 'h_state', 'h_queue', 'data', 'h_attempt')
    if f[1] == 'pending' and f[2] then
      if f[2] ~= qkey then return nil end
      redis.call('ZREM', waiting, top[1])
      return {top[1], top[2], f}
    end
    redis.call('ZREM', waiting, top[1])
  end
end
-- The oldest waiting call of this queue takes the released slot, leased to the worker as CLAIM would.
local function hand_off(slots, waiting, limit, qkey)
  if limit >= 0 and redis.call('ZCARD', slots) >= limit then return nil end
  local o = oldest(waiting, qkey)
  if not o then return nil end
  local id, f = o[1], o[3]
  redis.call('ZADD', slots, ARGV[17], id)
  redis.call('HSET', 'rq:job:' .. id, 'h_worker', ARGV[16], 'worker_name', ARGV[16], 'started_at', ARGV[18])
  redis.call('ZADD', KEYS[3], ARGV[17], id)
  return {id, f[3], f[4]}
end
-- The oldest waiting call of this queue, leased to the worker as a spare: it holds no slot and stays
-- pending until the worker starts it on a slot one of its calls releases (ARGV[19] of that call's end).
local function reserve(waiting, qkey)
  local o = oldest(waiting, qkey)
  if not o then return nil end
  local id, score, f = o[1], o[2], o[3]
  redis.call('HSET', 'rq:job:' .. id, 'h_worker', ARGV[16], 'worker_name', ARGV[16], 'h_spare', score)
  redis.call('ZADD', KEYS[3], ARGV[17], id)
  redis.call('ZADD', KEYS[8], score, id)  -- still counts as waiting for the queue size
  return {id, f[3], f[4], score}
end
-- The worker's spare takes the slot its ending call released (only while it is still that worker's spare).
local function take_spare(slots, id)
  local hk = 'rq:job:' .. id
  local f = redis.call('HMGET', hk, 'h_state', 'h_spare', 'h_worker')
  if f[1] ~= 'pending' or not f[2] or f[3] ~= ARGV[16] then return false end
  redis.call('HDEL', hk, 'h_spare')
  redis.call('ZREM', KEYS[8], id)
  redis.call('HSET', hk, 'started_at', ARGV[18])
  redis.call('ZADD', slots, ARGV[17], id)
  return true
end
-- The worker's oldest spare, if it is older than every waiting call: it takes the slot (the worker
-- starts it on the reply), so no younger waiting call starts before it on this worker.
local function own_spare(slots, waiting)
  local head = redis.call('ZRANGE', waiting, 0, 0, 'WITHSCORES')
  local cut = head[2] and tonumber(head[2]) or math.huge
  local spares = redis.call('ZRANGE', KEYS[8], 0, -1, 'WITHSCORES')
  for i = 1, #spares, 2 do
    if tonumber(spares[i + 1]) > cut then return nil end
    local id = spares[i]
    local f = redis.call('HMGET', 'rq:job:' .. id, 'h_worker', 'data', 'h_attempt')
    if f[1] == ARGV[16] and take_spare(slots, id) then return {id, f[2], f[3]} end
  end
  return nil
end
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
local before = tonumber(ARGV[21])
-- One increment for every event this call records: the earlier ones get seq .. seq + before - 1.
local seq = redis.call('HINCRBY', KEYS[1], 'h_seq', before + 1) - before
-- A spare that leaves ``pending`` (cancelled by its caller, say) is no longer one.
if st == 'pending' and ARGV[6] ~= '' and ARGV[6] ~= 'pending' and redis.call('ZREM', KEYS[8], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[1], 'h_spare')
end
-- The new state and the record's fields in one write.
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'h_state', ARGV[6], 'status', ARGV[7], unpack(ARGV, 22 + before, #ARGV))
elseif #ARGV >= 22 + before then
  redis.call('HSET', KEYS[1], unpack(ARGV, 22 + before, #ARGV))
end
local qkey = ARGV[16] ~= '' and rec[3]
if ARGV[8] == '-' then
  redis.call('ZREM', KEYS[3], ARGV[1])
elseif ARGV[8] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[8], ARGV[1])
end
local handed, spares, moved = nil, {}, false
if ARGV[12] == '1' then
  redis.call('ZREM', KEYS[4], ARGV[1])
  if redis.call('ZREM', KEYS[5], ARGV[1]) == 1 then
    local limit = limit_of(KEYS[6], ARGV[13])
    moved = qkey and ARGV[19] ~= '' and take_spare(KEYS[5], ARGV[19])
    if qkey and not moved then
      if limit < 0 or redis.call('ZCARD', KEYS[5]) < limit then handed = own_spare(KEYS[5], KEYS[4]) end
      handed = handed or hand_off(KEYS[5], KEYS[4], limit, qkey)
    end
    -- Free slots first (a raised limit): spares are taken only from the calls still waiting after that.
    promote(KEYS[5], KEYS[4], KEYS[6], ARGV[13], ARGV[15], limit)
    if qkey then
      for _ = 1, tonumber(ARGV[20]) or 0 do
        local spare = reserve(KEYS[4], qkey)
        if not spare then break end
        for _, v in ipairs(spare) do spares[#spares + 1] = v end
      end
    end
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
for i = 22, 21 + before do
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
if handed or #spares > 0 or ARGV[19] ~= '' then
  handed = handed or {'', '', ''}
  return {seq, st, handed[1], handed[2], handed[3], moved and 1 or 0, unpack(spares)}
end
return {seq, st}
"""
)

# KEYS: 1 call hash, 2 queue list, 3 history, 4 waiting zset, 5 rq:queues, 6 idempotency key,
#       7 slots zset, 8 limits hash, 9 spared zset
# ARGV: 1 call_id, 2 pending event payload, 3 ttl, 4 queue_size (-1 = unlimited), 5 waiting score,
#       6 channel, 7 queue key, 8 digest of the request under the idempotency key ('' = no key),
#       9 concurrency (-1 = unlimited), 10 concurrency key, 11 wake channel suffix, 12.. field/value
#       pairs of the job hash (with an idempotency key: ``h_idem`` its key, ``h_digest`` ARGV[8])
# Returns {1, call_id, queued 1 / waiting 0} accepted; {0, existing call_id[, its tool, its kind]}
# duplicate; {-1, depth} queue full (depth = calls waiting for a slot of this key, spares of workers
# included); {-2, existing call_id, its tool, its kind} the key belongs to a call with another digest.
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
  depth = depth + redis.call('ZCARD', KEYS[9])
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
