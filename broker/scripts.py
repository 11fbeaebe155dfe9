"""Lua scripts: every check-then-set on a call is one atomic script.

Events are msgpack maps; a script appends ``seq`` to the map it is given, so the sequence number is
assigned atomically with the state change and the history append, with no msgpack library in Lua.
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
_SLOTS = r"""
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
# ARGV: 1 call_id, 2 event payload, 3 ttl ('' = leave), 4 attempt fence ('' = none),
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
    + _SLOTS
    + r"""
local function hand_off(slots, waiting, limit, qkey)
  while limit < 0 or redis.call('ZCARD', slots) < limit do
    local top = redis.call('ZRANGE', waiting, 0, 0)
    if #top == 0 then return nil end
    local id = top[1]
    local hk = 'rq:job:' .. id
    local f = redis.call('HMGET', hk, 'h_state', 'h_queue', 'data', 'h_attempt')
    if f[1] == 'pending' and f[2] then
      if f[2] ~= qkey then return nil end  -- a queue this worker may not serve: promote() pushes it
      redis.call('ZREM', waiting, id)
      redis.call('ZADD', slots, ARGV[17], id)
      redis.call('HSET', hk, 'h_worker', ARGV[16], 'worker_name', ARGV[16], 'started_at', ARGV[18])
      redis.call('ZADD', KEYS[3], ARGV[17], id)
      return {id, f[3], f[4]}
    end
    redis.call('ZREM', waiting, id)  -- no longer pending: dropped, as promote() does
  end
  return nil
end
-- The oldest waiting call of this queue, leased to the worker as a spare: it holds no slot and stays
-- pending until the worker starts it on a slot one of its calls releases (ARGV[19] of that call's end).
local function reserve(waiting, qkey)
  while true do
    local top = redis.call('ZRANGE', waiting, 0, 0, 'WITHSCORES')
    if #top == 0 then return nil end
    local id = top[1]
    local hk = 'rq:job:' .. id
    local f = redis.call('HMGET', hk, 'h_state', 'h_queue', 'data', 'h_attempt')
    if f[1] == 'pending' and f[2] then
      if f[2] ~= qkey then return nil end
      redis.call('ZREM', waiting, id)
      redis.call('HSET', hk, 'h_worker', ARGV[16], 'worker_name', ARGV[16], 'h_spare', top[2])
      redis.call('ZADD', KEYS[3], ARGV[17], id)
      redis.call('ZADD', KEYS[8], top[2], id)  -- still counts as waiting for the queue size
      return {id, f[3], f[4], top[2]}
    end
    redis.call('ZREM', waiting, id)
  end
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
local rec = redis.call('HMGET', KEYS[1], 'h_state', 'h_attempt', 'h_queue')
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
#       6 channel, 7 queue key, 8 use idempotency ('1'/''), 9 concurrency (-1 = unlimited),
#       10 concurrency key, 11 wake channel suffix, 12.. field/value pairs of the job hash
# Returns {1, call_id, queued 1 / waiting 0} accepted; {0, existing call_id} duplicate;
# {-1, depth} queue full (depth = calls waiting for a slot of this key, spares of workers included).
SUBMIT = (
    _WITH_SEQ
    + _SLOTS
    + r"""
if ARGV[8] == '1' then
  local existing = redis.call('GET', KEYS[6])
  if existing then return {0, existing} end
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
if ARGV[8] == '1' then redis.call('SET', KEYS[6], ARGV[1], 'EX', ARGV[3]) end
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

# KEYS: 1 leases. ARGV: 1 now, 2 reaper lease deadline, 3 limit.
# Takes expired leases over (pushes their deadline out so one reaper owns them) and returns
# {call_id, state, attempt, max_attempts, queue, cancel, ckey, spare, ...} for the reaper to settle.
REAP = r"""
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  local f = redis.call('HMGET', 'rq:job:' .. id, 'h_state', 'h_attempt', 'h_max_attempts', 'h_queue', 'h_cancel', 'h_ckey',
                       'h_spare')
  if not f[1] then
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    out[#out + 1] = id
    for i = 1, 7 do out[#out + 1] = f[i] or '' end
  end
end
return out
"""

# KEYS: 1 limits hash. ARGV: 1 cut-off (slots whose deadline is older are checked), 2 max per key,
# 3 wake channel suffix.
# Frees slots still held by calls that ended, went back to retrying, or vanished (a safety net: every
# path that ends a call releases its slot in the same script), then refills; drops spare marks of calls
# that are no longer pending spares (their record expired, say). Returns slots freed.
SWEEP = (
    _SLOTS
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
  local spared = 'hermes:spared:' .. ckey
  for _, id in ipairs(redis.call('ZRANGE', spared, 0, tonumber(ARGV[2]) - 1)) do
    local f = redis.call('HMGET', 'rq:job:' .. id, 'h_state', 'h_spare')
    if f[1] ~= 'pending' or not f[2] then redis.call('ZREM', spared, id) end  -- gone, or no longer a spare
  end
  if redis.call('EXISTS', slots) == 0 and redis.call('EXISTS', waiting) == 0 and redis.call('EXISTS', spared) == 0 then
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
DUE = r"""
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  local f = redis.call('HMGET', 'rq:job:' .. id, 'h_state', 'h_attempt', 'h_trace', 'h_kind', 'h_tool',
                       'h_channel', 'h_ckey', 'origin', 'h_queue')
  if f[1] ~= 'retrying' then
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    out[#out + 1] = id
    for i = 1, 9 do out[#out + 1] = f[i] or '' end
  end
end
local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
out[#out + 1] = nxt[2] or ''
return out
"""

# KEYS: 1 leases, 2 limits hash. ARGV: 1 worker ('' = whichever holds them: the reaper's, for a dead
# worker), 2 wake channel suffix, 3.. call ids.
# Gives spares back: each call still a spare of that worker goes back to waiting at its old place and
# the free slots of its key are filled. Returns the ids left out because a cancel was asked for them
# (the caller ends those: their worker was to stop them; they stay leased, expired, so that the reaper
# ends any the caller does not).
SPARE_BACK = (
    _SLOTS
    + r"""
local cancelled = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local hk = 'rq:job:' .. id
  local f = redis.call('HMGET', hk, 'h_state', 'h_spare', 'h_worker', 'h_cancel', 'h_ckey')
  if f[1] == 'pending' and f[2] and (ARGV[1] == '' or f[3] == ARGV[1]) then
    redis.call('HDEL', hk, 'h_spare', 'h_worker', 'worker_name')
    if f[5] then redis.call('ZREM', 'hermes:spared:' .. f[5], id) end
    if f[4] == '1' then
      -- Left leased (expired at once): if the caller does not end it, the reaper does.
      redis.call('ZADD', KEYS[1], 0, id)
      cancelled[#cancelled + 1] = id
    else
      redis.call('ZREM', KEYS[1], id)
      if f[5] then
        local waiting = 'hermes:waiting:' .. f[5]
        redis.call('ZADD', waiting, f[2], id)
        promote('hermes:slots:' .. f[5], waiting, KEYS[2], f[5], ARGV[2])
      end
    end
  end
end
return cancelled
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
