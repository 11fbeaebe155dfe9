-- Library (prepended to the scripts that admit calls, before slots): a fleet-wide rate limiter on a
-- concurrency key, a sliding log, exact. A limiter is two keys of the queue's hash tag:
--   hash  hermes:rate:{q}:<ckey>     rpm, rps, tpm (its limits; absent = none), sum (tokens its log
--         counts), pause (ms: nothing is admitted before), seq, e:<call> (a call's token estimate, from
--         submission to its end), m:<call> (the log entry its admission took), t:<entry> (tokens counted)
--   zset  hermes:ratelog:{q}:<ckey>  entry -> when its request was sent (ms, Redis' clock), UNSENT from
--         admission until the worker says it sent it
-- and the queue tag's timer zset hermes:ratedue:{q} (concurrency key -> ms when capacity returns), which
-- each worker's scheduler reads to promote waiting calls then (no polling).
-- Exactness: an entry leaves the log only RATE_WINDOW ms after its request was sent (never while
-- unsent), and a call is admitted only while fewer than rpm entries are in the log, fewer than rps were
-- sent in the last second (or unsent), and sum + its estimate <= tpm; so any window of RATE_WINDOW ms
-- holds at most rpm sends: at the last admission in it every earlier send in it was still logged.
local UNSENT = 1e15
local RATE_WINDOW = 60000

local function rate_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The limiter of a concurrency key, or nil when the key has none (its hash has no limit).
local function rate_of(h, log, due, ckey)
  local cfg = redis.call('HMGET', h, 'rpm', 'rps', 'tpm')
  if not cfg[1] and not cfg[2] and not cfg[3] then return nil end
  return {h = h, log = log, due = due, ckey = ckey, rpm = tonumber(cfg[1] or '-1'),
          rps = tonumber(cfg[2] or '-1'), tpm = tonumber(cfg[3] or '-1')}
end

-- Entries sent more than the window ago leave the log with their tokens.
local function rate_trim(r, now)
  local old = redis.call('ZRANGEBYSCORE', r.log, '-inf', now - RATE_WINDOW)
  if #old == 0 then return end
  local freed = 0
  for _, m in ipairs(old) do
    freed = freed + tonumber(redis.call('HGET', r.h, 't:' .. m) or '0')
    redis.call('HDEL', r.h, 't:' .. m)
  end
  redis.call('ZREMRANGEBYSCORE', r.log, '-inf', now - RATE_WINDOW)
  if freed ~= 0 then redis.call('HINCRBY', r.h, 'sum', -freed) end
end

-- The call's admission is over: its entry counts `used` tokens ('' keeps its estimate; '-' its request
-- never left, so the entry goes back); an entry not stamped yet counts from now (a worker that did not
-- know the key is limited). `final`: the call ended, its estimate goes too.
local function rate_settle(r, call_id, used, final)
  if not r then return end
  local m = redis.call('HGET', r.h, 'm:' .. call_id)
  if m then
    local score = redis.call('ZSCORE', r.log, m)
    local old = tonumber(redis.call('HGET', r.h, 't:' .. m) or '0')
    if score and used == '-' then
      redis.call('ZREM', r.log, m)
      redis.call('HDEL', r.h, 't:' .. m)
      if old ~= 0 then redis.call('HINCRBY', r.h, 'sum', -old) end
    elseif score then
      if tonumber(score) >= UNSENT then redis.call('ZADD', r.log, 'XX', rate_now(), m) end
      if used ~= '' then
        redis.call('HSET', r.h, 't:' .. m, used)
        redis.call('HINCRBY', r.h, 'sum', tonumber(used) - old)
      end
    end
    redis.call('HDEL', r.h, 'm:' .. call_id)
  end
  if final then redis.call('HDEL', r.h, 'e:' .. call_id) end
end

-- 0 and the call's entry taken when it may be admitted now; else the ms time capacity returns for it
-- (UNSENT when that waits on requests not sent yet: their send arms the timer).
local function rate_take(r, call_id, now)
  local st = redis.call('HMGET', r.h, 'pause', 'e:' .. call_id)
  local pause = tonumber(st[1] or '0')
  if pause > now then return pause end
  rate_trim(r, now)
  local need = tonumber(st[2] or '0')
  if r.tpm >= 0 and need > r.tpm then need = r.tpm end  -- (a limit lowered under a waiting call)
  local at = 0
  if r.rpm >= 0 then
    local n = redis.call('ZCARD', r.log)
    if n >= r.rpm then
      local e = redis.call('ZRANGE', r.log, n - r.rpm, n - r.rpm, 'WITHSCORES')
      at = math.max(at, e[2] and tonumber(e[2]) + RATE_WINDOW or UNSENT)  -- (a share of 0: never)
    end
  end
  if r.rps >= 0 then
    local n = redis.call('ZCOUNT', r.log, '(' .. (now - 1000), '+inf')
    if n >= r.rps then
      local e = redis.call('ZRANGEBYSCORE', r.log, '(' .. (now - 1000), '+inf', 'WITHSCORES', 'LIMIT', n - r.rps, 1)
      at = math.max(at, e[2] and tonumber(e[2]) + 1000 or UNSENT)
    end
  end
  if r.tpm >= 0 and need > 0 then
    local over = tonumber(redis.call('HGET', r.h, 'sum') or '0') + need - r.tpm
    if over > 0 then
      local log = redis.call('ZRANGE', r.log, 0, -1, 'WITHSCORES')
      local when = UNSENT
      for i = 1, #log, 2 do
        over = over - tonumber(redis.call('HGET', r.h, 't:' .. log[i]) or '0')
        if over <= 0 then when = tonumber(log[i + 1]) + RATE_WINDOW break end
      end
      at = math.max(at, when)
    end
  end
  if at > 0 then return math.min(at, UNSENT) end
  -- An entry of an earlier admission still mapped (a path that re-admits without settling) counts on.
  if redis.call('HEXISTS', r.h, 'm:' .. call_id) == 1 then rate_settle(r, call_id, '', false) end
  local m = tostring(redis.call('HINCRBY', r.h, 'seq', 1))
  redis.call('ZADD', r.log, UNSENT, m)
  redis.call('HSET', r.h, 'm:' .. call_id, m, 't:' .. m, need)
  if need > 0 then redis.call('HINCRBY', r.h, 'sum', need) end
  return 0
end

-- Whether the call may be admitted now (its entry taken); when not, the timer is armed for its key.
local function rate_admits(r, call_id)
  if not r then return true end
  local at = rate_take(r, call_id, rate_now())
  if at == 0 then return true end
  if at < UNSENT then redis.call('ZADD', r.due, 'LT', at, r.ckey) end
  return false
end

