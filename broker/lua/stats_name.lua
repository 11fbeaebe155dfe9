-- STATS_NAME: admit a name to the values hermes:stats shows of one label (workers/telemetry.py).
-- KEYS[1] the label's set of names; ARGV[1] the name, ARGV[2] the most names the set holds.
-- 1: the name is (now) in the set; 0: the set is full without it (the caller counts it as "(other)").
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
return 1
