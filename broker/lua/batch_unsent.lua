-- BATCH_UNSENT: the result of a batch item that never became a call (refused arguments, or cancelled
-- while it waited for room), written once and counted with it, as TRANSITION writes a call's.
-- KEYS: 1 results hash (:r), 2 completion list (:o), 3 counts hash (:n)
-- ARGV: 1 the item's index, 2 its terminal event, 3 its state, 4 the ttl (seconds)
-- Returns 1 written, 0 the index had its result already.
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
