-- RATE_DUE: the concurrency keys whose rate limiter has capacity again by now (Redis' clock), each held
-- for `hold_ms` (so one worker promotes it; RATE_PROMOTE takes it off, a dead one's hold runs out).
-- KEYS: 1 the rate timer zset (of one queue tag)
-- ARGV: see the locals below. Returns {ckey, ..., the next due time in ms after them ('' when none)}.
local hold_ms = tonumber(ARGV[1])
local max = tonumber(ARGV[2])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, max)
for _, ckey in ipairs(out) do redis.call('ZADD', KEYS[1], now + hold_ms, ckey) end
local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
out[#out + 1] = nxt[2] or ''
return out
