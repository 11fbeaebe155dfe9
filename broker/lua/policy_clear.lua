-- POLICY_CLEAR: drop the pushed policy, keeping the version counter so a later push is still newer.
-- KEYS: 1 policy hash
-- ARGV: 1 channel. Returns the new version (0 when there was no policy).
local channel = ARGV[1]
if redis.call('HEXISTS', KEYS[1], 'data') == 0 then return 0 end
local v = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HDEL', KEYS[1], 'data', 'digest', 'pushed_at', 'source')
redis.call('PUBLISH', channel, v)
return v
