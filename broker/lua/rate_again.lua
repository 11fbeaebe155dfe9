-- RATE_AGAIN: a call's request failed and its worker would send it again: the sent entry stays in the
-- window with its tokens (the provider got it) and the call takes a new entry, as its admission took one.
-- KEYS: 1 rate limiter hash, 2 its log, 3 the rate timer zset (one queue tag)
-- ARGV: call id, concurrency key. Returns 0 when the entry is taken, else the ms to wait before asking
-- again (at most a second: capacity may wait on requests not sent yet).
local r = rate_of(KEYS[1], KEYS[2], KEYS[3], ARGV[2])
if not r then return 0 end
local now = rate_now()
local at = rate_take(r, ARGV[1], now)
if at == 0 then return 0 end
return math.max(1, math.min(at - now, 1000))
