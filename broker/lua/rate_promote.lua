-- RATE_PROMOTE: a rate limiter's timer fired: promote the key's waiting calls its limits now allow, in
-- fair order (the timer is armed again when some still wait on the limiter) (uses ratelimit, slots).
-- KEYS: 1 the rate timer zset, 2 slots zset, 3 interactive waiting zset, 4 limits hash, 5 queue list,
--       6 rate limiter hash, 7 its log, 8 batch waiting zset, 9 fair-state hash (one queue tag)
-- ARGV: see the locals below. Returns calls left waiting.
-- The records of the calls promoted are read at job_prefix .. id (their fairness key; same tag).
local ckey = ARGV[1]
local wake_channel = ARGV[2]
local job_prefix = ARGV[3]

redis.call('ZREM', KEYS[1], ckey)
promote(KEYS[2], KEYS[3], KEYS[8], KEYS[9], KEYS[5], limit_of(KEYS[4], ckey), wake_channel, job_prefix,
        rate_of(KEYS[6], KEYS[7], KEYS[1], ckey))
return redis.call('ZCARD', KEYS[3]) + redis.call('ZCARD', KEYS[8])
