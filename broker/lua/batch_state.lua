-- BATCH_STATE: set a batch's state unless it is `cancelled` (a cancel is never undone), refreshing the
-- meta's TTL; a meta that expired is not made again.
-- KEYS: 1 the batch's meta hash
-- ARGV: 1 the new state, 2 the ttl (seconds), then field/value pairs to write with it
-- Returns the state before ('' no such batch); the write happened unless that is 'cancelled' or ''.
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return '' end
if st == 'cancelled' then return st end
redis.call('HSET', KEYS[1], 'state', ARGV[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return st
