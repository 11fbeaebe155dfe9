-- POLICY_PUSH: store a pushed policy and tell the workers. Pushing the stored policy again changes
-- nothing and tells nobody.
-- KEYS: 1 policy hash
-- ARGV: see the locals below. Returns {version, changed}.
local data = ARGV[1]            -- the packed policy
local digest = ARGV[2]
local pushed_at = ARGV[3]
local source = ARGV[4]
local channel = ARGV[5]
if redis.call('HGET', KEYS[1], 'digest') == digest then
  return {tonumber(redis.call('HGET', KEYS[1], 'version')), 0}
end
local v = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'data', data, 'digest', digest, 'pushed_at', pushed_at, 'source', source)
redis.call('PUBLISH', channel, v)
return {v, 1}
