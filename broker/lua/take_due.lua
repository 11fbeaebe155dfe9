-- TAKE_DUE (REAP and DUE): the entries of a zset due by `now` whose record passes a check, held until
-- `hold` (so one caller owns them) and returned with their record's fields; the others leave the set.
-- KEYS: 1 the zset (a queue tag's leases, or its scheduled retries)
-- ARGV: see the locals below
-- REAP (mode 'reap'): expired leases; returns {call_id, state, attempt, max_attempts, queue, cancel,
--   ckey, ...} for the reaper to settle (a record that is gone just leaves the set).
-- DUE (mode 'due'): retries that are due: {call_id, state, attempt, trace, kind, tool, channel, ckey,
--   origin, queue, session, ...}, then the next due time after them ('' when none).
-- Records are read at job_prefix .. id: ids carry the queue's tag, so they live in this slot. An entry whose
-- record is not here is held too and its id returned as absent, the reply's last element (a list): on a
-- cluster the record may be on its way to another node (a slot migration), so the caller asks again where
-- redirections are followed and takes the entry out only when the record is gone.
local now = ARGV[1]
local hold = ARGV[2]
local max = tonumber(ARGV[3])
local job_prefix = ARGV[4]
local mode = ARGV[5]

local fields
if mode == 'reap' then
  fields = {'h_state', 'h_attempt', 'h_max_attempts', 'h_queue', 'h_cancel', 'h_ckey'}
else
  fields = {'h_state', 'h_attempt', 'h_trace', 'h_kind', 'h_tool', 'h_channel', 'h_ckey', 'origin', 'h_queue', 'h_session'}
end
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, max)
local out = {}
local absent = {}
for _, id in ipairs(ids) do
  local f = redis.pcall('HMGET', job_prefix .. id, unpack(fields))
  if f.err then f = {} end  -- already moved to another node (a slot migration): held, asked again as absent
  if f[1] and (mode == 'reap' or f[1] == 'retrying') then
    redis.call('ZADD', KEYS[1], hold, id)
    out[#out + 1] = id
    for i = 1, #fields do out[#out + 1] = f[i] or '' end
  elseif not f[1] then
    redis.call('ZADD', KEYS[1], hold, id)
    absent[#absent + 1] = id
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
if mode == 'due' then
  local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  out[#out + 1] = nxt[2] or ''
end
out[#out + 1] = absent
return out
