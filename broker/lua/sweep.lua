-- SWEEP: free slots of one concurrency key still held by calls that ended, went back to retrying or
-- vanished (a safety net: every path that ends a call releases its slot in the same script), then refill
-- (uses ratelimit, slots). Drops the key from the limits hash once nothing holds or waits for its slots.
-- KEYS: 1 slots zset, 2 interactive waiting zset, 3 limits hash, 4 queue list, 5 batch waiting zset,
--       6 fair-state hash, 7 rate limiter hash, 8 its log, 9 the rate timer zset (of one queue tag; 1, 2,
--       5-8 of the concurrency key)
-- ARGV: see the locals below. Returns slots freed.
-- Records of the ids found in the slot set, and of the waiting calls promoted, are read at
-- job_prefix .. id (same tag, same slot).
local cutoff = ARGV[1]          -- slots whose deadline is older are checked
local max = tonumber(ARGV[2])
local ckey = ARGV[3]
local job_prefix = ARGV[4]
local wake_channel = ARGV[5]

local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff, 'LIMIT', 0, max)
local freed = 0
for _, id in ipairs(stale) do
  local st = redis.pcall('HGET', job_prefix .. id, 'h_state')
  if type(st) == 'table' then  -- already moved to another node (a slot migration): looked at next time
  elseif not st or st == 'done' or st == 'failed' or st == 'cancelled' or st == 'retrying' then
    redis.call('ZREM', KEYS[1], id)
    freed = freed + 1
  end
end
if freed > 0 then
  promote(KEYS[1], KEYS[2], KEYS[5], KEYS[6], KEYS[4], limit_of(KEYS[3], ckey), wake_channel, job_prefix,
          rate_of(KEYS[7], KEYS[8], KEYS[9], ckey))
end
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('EXISTS', KEYS[5]) == 0 then
  redis.call('DEL', KEYS[6])  -- (nobody waits: no fair state; left over only by a call lost while waiting)
  if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('HDEL', KEYS[3], ckey) end
end
return freed
