-- RATE_PAUSE: the provider refused a request for its rate (429 or 503 with a time to wait): nothing more
-- is admitted on the key until `seconds` from now (Redis' clock; a later pause already set stays), and
-- the refused request's entry counts no tokens (it stays in the window: the provider counted it).
-- KEYS: 1 rate limiter hash, 2 its log (one queue tag)
-- ARGV: see the locals below. Returns the pause's end (ms).
local call_id = ARGV[1]
local seconds = tonumber(ARGV[2])

local now = rate_now()
local pause_end = now + math.ceil(seconds * 1000)
local was = tonumber(redis.call('HGET', KEYS[1], 'pause') or '0')
if was > pause_end then pause_end = was end
redis.call('HSET', KEYS[1], 'pause', pause_end)
local m = redis.call('HGET', KEYS[1], 'm:' .. call_id)
if m then
  local old = tonumber(redis.call('HGET', KEYS[1], 't:' .. m) or '0')
  if old ~= 0 then
    redis.call('HSET', KEYS[1], 't:' .. m, 0)
    redis.call('HINCRBY', KEYS[1], 'sum', -old)
  end
end
return pause_end
