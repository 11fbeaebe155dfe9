-- BREAKER_RECORD: count a call's outcome against its breaker; open or close it (keys of the {hermes:brk} tag)
-- KEYS: 1 breaker hash, 2 window hash, 3 breakers set
-- ARGV: see the locals below
-- Returns {state after, state before, reason}.
local now_arg = ARGV[1]
local outcome_arg = ARGV[2]     -- ok | fail | neutral
local call_id = ARGV[3]
local threshold_arg = ARGV[4]   -- consecutive failures that open it (0 = rule off)
local rate_arg = ARGV[5]        -- failure rate that opens it (0 = rule off)
local window_arg = ARGV[6]      -- window seconds
local min_calls = ARGV[7]       -- min calls in the window
local error_type = ARGV[8]
local breaker_key = ARGV[9]
local f = redis.call('HMGET', KEYS[1], 'state', 'probe')
local state = f[1] or 'closed'
local now = tonumber(now_arg)
local outcome = outcome_arg
local function open(reason)
  redis.call('HSET', KEYS[1], 'state', 'open', 'opened_at', now, 'changed_at', now, 'failures', 0,
             'probe', '', 'probe_until', 0, 'reason', reason, 'last_error', error_type)
  redis.call('DEL', KEYS[2])
  redis.call('SADD', KEYS[3], breaker_key)
end
if state == 'half_open' then
  if f[2] ~= call_id then return {state, state, ''} end
  if outcome == 'ok' then
    redis.call('HSET', KEYS[1], 'state', 'closed', 'changed_at', now, 'failures', 0, 'probe', '',
               'probe_until', 0, 'reason', 'probe succeeded')
    redis.call('DEL', KEYS[2])
    return {'closed', 'half_open', 'probe succeeded'}
  elseif outcome == 'fail' then
    open('probe failed')
    return {'open', 'half_open', 'probe failed'}
  end
  redis.call('HSET', KEYS[1], 'probe', '', 'probe_until', 0)
  return {'half_open', 'half_open', ''}
end
if state == 'open' or outcome == 'neutral' then return {state, state, ''} end
local reason = ''
local threshold = tonumber(threshold_arg)
if outcome == 'ok' then
  if threshold > 0 then redis.call('HSET', KEYS[1], 'failures', 0) end
else
  local n = redis.call('HINCRBY', KEYS[1], 'failures', 1)
  redis.call('HSET', KEYS[1], 'last_error', error_type)
  if threshold > 0 and n >= threshold then reason = n .. ' consecutive failures' end
end
local rate = tonumber(rate_arg)
if rate > 0 then
  local window = tonumber(window_arg)
  local width = window / 10
  local b = math.floor(now / width)
  redis.call('HINCRBY', KEYS[2], 'c' .. b, 1)
  if outcome == 'fail' then redis.call('HINCRBY', KEYS[2], 'f' .. b, 1) end
  redis.call('EXPIRE', KEYS[2], math.ceil(window + width))
  local calls, fails = 0, 0
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    local kind, at = string.sub(all[i], 1, 1), tonumber(string.sub(all[i], 2))
    if at <= b - 10 then
      redis.call('HDEL', KEYS[2], all[i])
    elseif kind == 'c' then
      calls = calls + tonumber(all[i + 1])
    else
      fails = fails + tonumber(all[i + 1])
    end
  end
  if reason == '' and calls >= tonumber(min_calls) and fails / calls >= rate then
    reason = fails .. ' of ' .. calls .. ' calls failed in ' .. window_arg .. 's'
  end
end
if reason ~= '' then
  open(reason)
  return {'open', 'closed', reason}
end
return {'closed', 'closed', ''}
