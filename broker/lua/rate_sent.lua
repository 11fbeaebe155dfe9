-- RATE_SENT: a call's request was sent: its limiter entry is stamped with the time (Redis' clock), from
-- which the window counts it; while calls wait on the key, the timer is armed for when it leaves the
-- window (uses ratelimit).
-- KEYS: 1 rate limiter hash, 2 its log, 3 the rate timer zset, 4 and 5 the key's waiting zsets
--       (interactive, batch) (one queue tag)
-- ARGV: see the locals below. Returns 1 when an entry was stamped, else 0 (no limiter, or none taken).
local call_id = ARGV[1]
local ckey = ARGV[2]
local slack = tonumber(ARGV[3])  -- ms added: the stamp may reach Redis before the request the provider

local r = rate_of(KEYS[1], KEYS[2], KEYS[3], ckey)
if not r then return 0 end
local m = redis.call('HGET', KEYS[1], 'm:' .. call_id)
if not m or redis.call('ZSCORE', KEYS[2], m) == false then return 0 end
local now = rate_now() + slack
redis.call('ZADD', KEYS[2], 'XX', now, m)
if redis.call('ZCARD', KEYS[4]) + redis.call('ZCARD', KEYS[5]) > 0 then
  local window = RATE_WINDOW
  if r.rps >= 0 then window = 1000 end
  redis.call('ZADD', KEYS[3], 'LT', now + window, ckey)
end
return 1
