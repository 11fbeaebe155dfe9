-- Library (prepended to the scripts that give or take concurrency slots).
-- A call is *waiting* until it can take a slot of its concurrency key; it then holds the slot (score
-- +inf while queued, its lease deadline once claimed) until it ends or goes back to retrying. Only calls
-- holding a slot are on the queue, so a worker never blocks on a limit. The waiting sets, the fair-state
-- hash, the slot set and the queue of a key share the queue's hash tag.
-- Fair dispatch (start-time fair queueing): a key's waiting calls are in two zsets, one per class
-- (interactive, batch), each scored by a virtual *tag*: a call of fairness key k in class c gets
-- tag = max(vt[c], last[c,k]) + inc(k) (inc = UNIT / weight(k), an integer), so ZPOPMIN of a class is
-- weighted round robin across the keys waiting, FIFO within a key. The fair hash holds, per class c:
-- `v:c` the tag of the last call promoted (starts at the time in µs: calls waiting from before keep their
-- order), and per key k waiting there `l:c:k` its last tag and `n:c:k` its calls waiting; besides them the
-- batch credit `cr` and the batch share `sh` (per 10,000, written by SUBMIT: promotions in other scripts use it).
-- It is deleted once neither class waits, so it holds only keys that wait.
-- Invariant: an id in a waiting set is pending (every move out of pending removes it).
-- A key with a rate limit (`rate`, from ratelimit's rate_of; nil without) also needs the limiter's
-- admission for the call whose turn it is: when it refuses, that call keeps its place (nothing is popped)
-- and the limiter's timer promotes it when capacity returns.
local SHARE_SCALE = 10000
local DEFAULT_SHARE = 1000      -- fairness.batch_share 0.1 until a SUBMIT writes the configured one
local UNIT = 1000000            -- a weight-1 key's tag step (broker.submits.UNIT)

local function limit_of(limits, ckey)
  return tonumber(redis.call('HGET', limits, ckey) or '-1')
end
local function class_of(klass)
  if klass == 'batch' then return 'b' end
  return 'i'
end
-- One more call of (class c, key k) waits: its tag (`score` when given, e.g. 0 for a call handed back
-- before everyone; else the key's next turn) and its count.
local function fair_wait(fair, c, k, inc, score, now)
  local n = redis.call('HINCRBY', fair, 'n:' .. c .. ':' .. k, 1)
  if score ~= '' then return score end
  local f = redis.call('HMGET', fair, 'v:' .. c, 'l:' .. c .. ':' .. k)
  local vt = tonumber(f[1])
  if not vt then
    vt = now
    redis.call('HSET', fair, 'v:' .. c, vt)
  end
  local last = tonumber(f[2])
  if not last or last < vt then last = vt end
  local tag = last + inc
  redis.call('HSET', fair, 'l:' .. c .. ':' .. k, tag)
  return tag
end
-- A call of (class c, key k) no longer waits: its count down; a key with none left leaves the hash.
local function fair_left(fair, c, k)
  if redis.call('HINCRBY', fair, 'n:' .. c .. ':' .. k, -1) <= 0 then
    redis.call('HDEL', fair, 'n:' .. c .. ':' .. k, 'l:' .. c .. ':' .. k)
  end
end
-- The next waiting call to promote (nil when none), read only: the class by the batch credit when both
-- wait, then the lowest tag of that class; {id, tag, class, set, both waiting, credit to store or nil}.
local function next_fair(wi, wb, fair)
  local ni = redis.call('ZCARD', wi)
  local nb = redis.call('ZCARD', wb)
  if ni + nb == 0 then return nil end
  local c, set, credit = 'i', wi, nil
  if ni == 0 then
    c, set = 'b', wb
  elseif nb > 0 then
    local f = redis.call('HMGET', fair, 'cr', 'sh')
    credit = (tonumber(f[1]) or 0) + (tonumber(f[2]) or DEFAULT_SHARE)
    if credit >= SHARE_SCALE then
      c, set = 'b', wb
      credit = credit - SHARE_SCALE
    end
  end
  local top = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  return {top[1], tonumber(top[2]), c, set, ni + nb, credit}
end
-- Take the call next_fair chose off waiting.
local function pop_fair(wi, wb, fair, job_prefix, pick)
  local id, tag, c, set, total, credit = pick[1], pick[2], pick[3], pick[4], pick[5], pick[6]
  if credit then redis.call('HSET', fair, 'cr', credit) end
  redis.call('ZREM', set, id)
  if total == 1 then
    redis.call('DEL', fair)
  else
    local vt = tonumber(redis.call('HGET', fair, 'v:' .. c))
    if not vt or tag > vt then redis.call('HSET', fair, 'v:' .. c, tag) end
    fair_left(fair, c, redis.call('HGET', job_prefix .. id, 'h_fkey') or '')
  end
  return id
end
-- Fill free slots with the next waiting calls (fair order), pushing each onto the queue; one wake-up if
-- any moved. (Promotion is this one function: whatever else may hold a call back goes here.)
local function promote(slots, wi, wb, fair, queue, limit, wake_channel, job_prefix, rate)
  local moved = false
  while limit < 0 or redis.call('ZCARD', slots) < limit do
    local pick = next_fair(wi, wb, fair)
    if not pick or not rate_admits(rate, pick[1]) then break end
    local id = pop_fair(wi, wb, fair, job_prefix, pick)
    redis.call('ZADD', slots, 'inf', id)
    redis.call('RPUSH', queue, id)
    moved = true
  end
  if moved then redis.call('PUBLISH', wake_channel, '') end
end
-- A call leaves waiting without being promoted (cancelled, failed): out of its class's set and counts.
local function unwait(wi, wb, fair, call_id, fkey)
  local c = 'i'
  if redis.call('ZREM', wi, call_id) == 0 then
    if redis.call('ZREM', wb, call_id) == 0 then return end
    c = 'b'
  end
  if redis.call('EXISTS', wi) == 0 and redis.call('EXISTS', wb) == 0 then
    redis.call('DEL', fair)
  else
    fair_left(fair, c, fkey or '')
  end
end
-- Admit an accepted call again (a retry): a free slot when nobody waits, else it waits in its class at
-- `score` ('' = its key's next turn, at weight 1).
local function admit(slots, wi, wb, fair, queue, limit, call_id, score, wake_channel, job_prefix, fkey, klass, now, rate)
  local free = redis.call('ZCARD', wi) + redis.call('ZCARD', wb) == 0
      and (limit < 0 or redis.call('ZCARD', slots) < limit)
  if free and rate_admits(rate, call_id) then
    redis.call('ZADD', slots, 'inf', call_id)
    redis.call('RPUSH', queue, call_id)
    redis.call('PUBLISH', wake_channel, '')
  else
    local c = class_of(klass)
    local tag = fair_wait(fair, c, fkey, UNIT, score, now)
    if c == 'b' then redis.call('ZADD', wb, tag, call_id) else redis.call('ZADD', wi, tag, call_id) end
    if not free then promote(slots, wi, wb, fair, queue, limit, wake_channel, job_prefix, rate) end
  end
end
