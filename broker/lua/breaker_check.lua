-- BREAKER_CHECK: may a call go through a circuit breaker? (keys of the {hermes:brk} tag)
-- KEYS: 1 breaker hash, 2 breakers set
-- ARGV: see the locals below
-- Returns {decision allow|probe|reject, state before, retry_at or ''}.
local now_arg = ARGV[1]
local cooldown = ARGV[2]
local call_id = ARGV[3]
local probe_until = ARGV[4]     -- the probe's deadline
local breaker_key = ARGV[5]     -- the breaker's name, for the breakers set
local f = redis.call('HMGET', KEYS[1], 'state', 'opened_at', 'probe', 'probe_until')
local state = f[1] or 'closed'
if state == 'closed' then return {'allow', 'closed', ''} end
local now = tonumber(now_arg)
if state == 'open' then
  local reopen = tonumber(f[2] or 0) + tonumber(cooldown)
  if now < reopen then return {'reject', 'open', tostring(reopen)} end
  redis.call('HSET', KEYS[1], 'state', 'half_open', 'probe', call_id, 'probe_until', probe_until, 'changed_at', now)
  redis.call('SADD', KEYS[2], breaker_key)
  return {'probe', 'open', ''}
end
if f[3] == call_id then return {'probe', 'half_open', ''} end
if tonumber(f[4] or 0) < now then
  redis.call('HSET', KEYS[1], 'probe', call_id, 'probe_until', probe_until)
  return {'probe', 'half_open', ''}
end
return {'reject', 'half_open', f[4] or ''}
