-- Library (prepended to the scripts that give or take concurrency slots).
-- A call is *waiting* (zset by submit time, bounded by queue_size) until it can take a slot of its
-- concurrency key; it then holds the slot (score +inf while queued, its lease deadline once claimed)
-- until it ends or goes back to retrying. Only calls holding a slot are on the queue, so a worker never
-- blocks on a limit. The waiting set, the slot set and the queue of a key share the queue's hash tag.
-- Invariant: an id in a waiting set is pending (every move out of pending removes it), so promoting
-- it reads no job hash. A key with a rate limit (`rate`, from ratelimit's rate_of; nil without) also
-- needs the limiter's admission for the call at the head: when it refuses, the head keeps its place and
-- the limiter's timer promotes it when capacity returns.
local function limit_of(limits, ckey)
  return tonumber(redis.call('HGET', limits, ckey) or '-1')
end
-- Fill free slots with the oldest waiting calls, pushing each onto the queue; one wake-up if any moved.
local function promote(slots, waiting, queue, limit, wake_channel, rate)
  local moved = false
  while limit < 0 or redis.call('ZCARD', slots) < limit do
    local top
    if rate then
      top = redis.call('ZRANGE', waiting, 0, 0)
      if #top == 0 or not rate_admits(rate, top[1]) then break end
      redis.call('ZREM', waiting, top[1])
    else
      top = redis.call('ZPOPMIN', waiting)
      if #top == 0 then break end
    end
    redis.call('ZADD', slots, 'inf', top[1])
    redis.call('RPUSH', queue, top[1])
    moved = true
  end
  if moved then redis.call('PUBLISH', wake_channel, '') end
end
-- Admit an accepted call: a free slot when nobody waits before it, else it waits (at `score`).
local function admit(slots, waiting, queue, limit, call_id, score, wake_channel, rate)
  if redis.call('ZCARD', waiting) == 0 and (limit < 0 or redis.call('ZCARD', slots) < limit) then
    if rate_admits(rate, call_id) then
      redis.call('ZADD', slots, 'inf', call_id)
      redis.call('RPUSH', queue, call_id)
      redis.call('PUBLISH', wake_channel, '')
    else
      redis.call('ZADD', waiting, score, call_id)  -- (the limiter's timer promotes it)
    end
  else
    redis.call('ZADD', waiting, score, call_id)
    promote(slots, waiting, queue, limit, wake_channel, rate)
  end
end
