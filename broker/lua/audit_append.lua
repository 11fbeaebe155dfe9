-- AUDIT_APPEND: append an audit record to the stream and index it by call id; trim both (keys of the
-- {hermes:audit} tag)
-- KEYS: 1 audit stream, 2 audit index zset (call_id -> ms part of its stream id)
-- ARGV: see the locals below, then the record's field/value pairs. Returns the new stream id (or false).
local maxlen = ARGV[1]          -- '0' = no count cap
local minid = ARGV[2]           -- '0' = no age cap
local approx = ARGV[3]          -- '~' or '='
local call_id = ARGV[4]         -- '' = trim only
local FIELDS = 5
local id = false
if call_id ~= '' then
  id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, FIELDS))
  redis.call('ZADD', KEYS[2], string.match(id, '^(%d+)'), call_id)
end
local trimmed = 0
if maxlen ~= '0' then trimmed = trimmed + redis.call('XTRIM', KEYS[1], 'MAXLEN', approx, maxlen) end
if minid ~= '0' then trimmed = trimmed + redis.call('XTRIM', KEYS[1], 'MINID', approx, minid) end
-- The index follows the stream: after records went (or on an explicit trim), drop what is older than it.
if trimmed > 0 or not id then
  local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
  if first[1] then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.match(first[1][1], '^(%d+)'))
  else
    redis.call('DEL', KEYS[2])
  end
end
return id
