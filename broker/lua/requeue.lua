-- REQUEUE: a call leased but never started that still holds its slot and is pending goes back to the
-- head of its queue, unleased, keeping the slot.
-- KEYS: 1 leases zset, 2 slots zset of its key, 3 its queue list, 4 its job hash
-- ARGV: see the locals below. Returns 1, or 0 when it did not qualify (nothing done).
local call_id = ARGV[1]
local wake_channel = ARGV[2]

if not redis.call('ZSCORE', KEYS[2], call_id) or redis.call('HGET', KEYS[4], 'h_state') ~= 'pending' then
  return 0
end
redis.call('ZADD', KEYS[2], 'inf', call_id)
redis.call('LPUSH', KEYS[3], call_id)
redis.call('ZREM', KEYS[1], call_id)
redis.call('PUBLISH', wake_channel, '')
return 1
