-- Library (prepended to the scripts that give or take concurrency slots).
-- A call is *waiting* until it can take a slot of its concurrency key; it then holds the slot (score
-- +inf while queued, its lease deadline once claimed) until it ends or goes back to retrying. Only calls
-- holding a slot are on the queue, so a worker never blocks on a limit. The waiting sets, the fair-state
-- hash, the slot set and the queue of a key share the queue's hash tag.
-- Fair dispatch (start-time fair queueing): a key's waiting calls are in two zsets, one per class
-- (interactive, batch), each scored by a virtual *tag*: a call of fairness key k in class c gets
-- tag = max(head[c], last[c,k]) + inc(k), where head[c] is the tag of the call next in line in c (the time
-- in µs when none waits) and inc = UNIT / weight(k), an integer. So ZPOPMIN of a class is weighted round
-- robin across the keys waiting, FIFO within a key. The fair hash holds, per key k waiting in class c,
-- `l:c:k` its last tag and `n:c:k` its calls waiting; besides them the batch credit `cr` and the batch
-- share `sh` (per 10,000, written by SUBMIT: promotions in other scripts use it). A key with nothing
-- waiting leaves the hash, and the hash goes once neither class waits.
-- Invariant: an id in a waiting set is pending (every move out of pending removes it).
-- A key with a rate limit (`rate`, from ratelimit's rate_of; nil without) also needs the limiter's
-- admission for the call whose turn it is: when it refuses, that call keeps its place (nothing is popped)
-- and the limiter's timer promotes it when capacity returns.
local SHARE_SCALE = 10000
local DEFAULT_SHARE = 1000      -- fairness.batch_share 0.1 until a SUBMIT writes the configured one
local UNIT = 1000000            -- a weight-1 key's tag step (broker.calls.UNIT)

local function limit_of(limits, ckey)
  return tonumber(redis.call('HGET', limits, ckey) or '-1')
end
-- The waiting set of a class ('b' batch, else 'i').
local function set_of(c, wi, wb)
  if c == 'b' then return wb end
  return wi
end
-- One more call of (class c, key k) waits in `set` (`n`: its key's count before, `last` its last tag,
-- both from the fair hash); `score` '' = the key's next turn, else that place ('first' = before every
-- waiting call, as a call handed back goes). `extra`: more fields to write to the hash.
-- A key with calls waiting has its last tag at or past the head (its calls are in line): no head to read.
local function fair_wait(fair, set, c, k, inc, score, now, n, last, call_id, extra)
  local tag
  if score == 'first' then
    local head = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
    tag = (tonumber(head[2]) or now) - 1
    redis.call('HSET', fair, 'n:' .. c .. ':' .. k, n + 1, unpack(extra))
  else
    local base = last
    if n == 0 or not base then
      local head = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
      base = tonumber(head[2]) or now
    end
    tag = base + inc
    redis.call('HSET', fair, 'n:' .. c .. ':' .. k, n + 1, 'l:' .. c .. ':' .. k, tag, unpack(extra))
  end
  redis.call('ZADD', set, tag, call_id)
end
-- A call of (class c, key k) no longer waits: its count down; a key with none left leaves the hash, and
-- the hash goes when nobody waits.
local function fair_left(fair, wi, wb, c, k)
  if redis.call('HINCRBY', fair, 'n:' .. c .. ':' .. k, -1) <= 0 then
    if redis.call('EXISTS', wi, wb) == 0 then
      redis.call('DEL', fair)
    else
      redis.call('HDEL', fair, 'n:' .. c .. ':' .. k, 'l:' .. c .. ':' .. k)
    end
  end
end
-- The next waiting call to promote (nil when none): the class by the batch credit when both wait, then
-- the lowest tag of that class; {id, class, its set, the credit to store (false: none), popped}. `pop`:
-- take it off its set now (ZPOPMIN: nothing, no limiter, needs to see it first), else read only.
-- (Nobody waiting costs one EXISTS; one class waiting, EXISTS and a ZRANGE or ZPOPMIN.)
local function next_fair(wi, wb, fair, pop)
  local sets = redis.call('EXISTS', wi, wb)
  if sets == 0 then return nil end
  local c, set, credit = 'i', wi, false
  if sets == 2 then
    local f = redis.call('HMGET', fair, 'cr', 'sh')
    credit = (tonumber(f[1]) or 0) + (tonumber(f[2]) or DEFAULT_SHARE)
    if credit >= SHARE_SCALE then
      c, set = 'b', wb
      credit = credit - SHARE_SCALE
    end
  end
  local top
  if pop then top = redis.call('ZPOPMIN', set) else top = redis.call('ZRANGE', set, 0, 0) end
  if #top == 0 and sets == 1 then
    c, set = 'b', wb
    if pop then top = redis.call('ZPOPMIN', set) else top = redis.call('ZRANGE', set, 0, 0) end
  end
  if #top == 0 then return nil end
  return {top[1], c, set, credit, pop}
end
-- Take the call next_fair chose off waiting.
local function pop_fair(wi, wb, fair, job_prefix, pick)
  local id, c, set, credit = pick[1], pick[2], pick[3], pick[4]
  if credit then redis.call('HSET', fair, 'cr', credit) end
  if not pick[5] then redis.call('ZREM', set, id) end
  fair_left(fair, wi, wb, c, redis.call('HGET', job_prefix .. id, 'h_fkey') or '')
  return id
end
-- Fill free slots with the next waiting calls (fair order), pushing each onto the queue; one wake-up if
-- any moved. (Promotion is this one function: whatever else may hold a call back goes here.)
local function promote(slots, wi, wb, fair, queue, limit, wake_channel, job_prefix, rate)
  local moved = false
  local held = 0  -- slots held (counted once: each call promoted takes one more)
  if limit >= 0 then held = redis.call('ZCARD', slots) end
  while limit < 0 or held < limit do
    local pick = next_fair(wi, wb, fair, rate == nil)
    if not pick or not rate_admits(rate, pick[1]) then break end
    local id = pop_fair(wi, wb, fair, job_prefix, pick)
    redis.call('ZADD', slots, 'inf', id)
    redis.call('RPUSH', queue, id)
    held = held + 1
    moved = true
  end
  if moved and wake_channel ~= '' then redis.call('PUBLISH', wake_channel, '') end
  return moved
end
-- A call leaves waiting without being promoted (cancelled, failed): out of its class's set and counts
-- (`job`: its record, for its fairness key).
local function unwait(wi, wb, fair, call_id, job)
  local c = 'i'
  if redis.call('ZREM', wi, call_id) == 0 then
    if redis.call('ZREM', wb, call_id) == 0 then return end
    c = 'b'
  end
  fair_left(fair, wi, wb, c, redis.call('HGET', job, 'h_fkey') or '')
end
-- Admit an accepted call again (a retry): a free slot when nobody waits, else it waits in its class at
-- `score` ('' = its key's next turn, at weight 1; 'first' = before every waiting call).
local function admit(slots, wi, wb, fair, queue, limit, call_id, score, wake_channel, job_prefix, fkey, klass, now, rate)
  local free = redis.call('EXISTS', wi, wb) == 0 and (limit < 0 or redis.call('ZCARD', slots) < limit)
  if free and rate_admits(rate, call_id) then
    redis.call('ZADD', slots, 'inf', call_id)
    redis.call('RPUSH', queue, call_id)
    redis.call('PUBLISH', wake_channel, '')
  else
    local c = 'i'
    if klass == 'batch' then c = 'b' end
    local f = redis.call('HMGET', fair, 'n:' .. c .. ':' .. fkey, 'l:' .. c .. ':' .. fkey)
    fair_wait(fair, set_of(c, wi, wb), c, fkey, UNIT, score, now, tonumber(f[1]) or 0, tonumber(f[2]), call_id, {})
    if not free then promote(slots, wi, wb, fair, queue, limit, wake_channel, job_prefix, rate) end
  end
end
