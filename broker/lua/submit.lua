-- SUBMIT: accept a call with its `pending` event (uses with_seq, ratelimit, slots).
-- KEYS: 1 job hash, 2 queue list, 3 history list, 4 interactive waiting zset, 5 idempotency key (of the
--       queue's tag; its name with an empty key when the call has none), 6 slots zset, 7 limits hash,
--       8 batch waiting zset, 9 fair-state hash, 10 rate limiter hash, 11 its log (4, 6, 8-11 of the
--       call's concurrency key), 12 the tag's rate timer zset (see ratelimit), 13 the tag's set of keys
--       with a rate limiter
-- ARGV: see the locals below; then field/value pairs of the job hash (with an idempotency key: `h_idem`
--       its key, `h_digest` the request digest)
-- Returns {1, call_id, queued 1 / waiting 0} accepted; {0, existing call_id[, its tool, its kind]}
-- duplicate; {-1, depth} queue full (depth = calls waiting for a slot of this key: interactive ones for an
-- interactive call, both classes for a batch call); {-2,
-- existing call_id, its tool, its kind} the idempotency key belongs to a call with another digest; {-3,
-- waiting, per-key size, fairness key} the call's fairness key has `queue_size_per_key` calls waiting.
-- The existing call an idempotency key names is read at job_prefix .. its id: ids carry their queue's
-- hash tag, so that record lives in this slot (one of the few keys not passed in KEYS); so are the
-- records of the calls promote pops (their fairness key).
local call_id = ARGV[1]
local event = ARGV[2]
local ttl = ARGV[3]
local queue_size = tonumber(ARGV[4])
local score = ARGV[5]
local channel = ARGV[6]
local digest = ARGV[7]
local concurrency = ARGV[8]
local ckey = ARGV[9]
local wake_channel = ARGV[10]
local publish = ARGV[11]        -- PUBLISH, or SPUBLISH on a cluster
local job_prefix = ARGV[12]
local fkey = ARGV[13]           -- the call's fairness key
local klass = ARGV[14]          -- interactive | batch
local inc = tonumber(ARGV[15])  -- its tag step: UNIT / the key's weight
local share = ARGV[16]          -- fairness.batch_share, per 10,000
local key_size = tonumber(ARGV[17])  -- fairness.queue_size_per_key (-1 = none)
local rate_limits = ARGV[18]    -- 'rpm rps tpm' of the key's rate limit (-1: none of that kind), '' none
local estimate = ARGV[19]       -- tokens the call reserves from the limiter ('0' for a tool call)
local FIELDS = 20

if digest ~= '' then
  local existing = redis.call('GET', KEYS[5])
  if existing then
    local f = redis.call('HMGET', job_prefix .. existing, 'h_tool', 'h_kind', 'h_digest')
    if f[1] then
      if f[3] and f[3] ~= digest then return {-2, existing, f[1], f[2] or ''} end
      return {0, existing, f[1], f[2] or ''}
    end
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, call_id} end
local limit = tonumber(concurrency)
redis.call('HSET', KEYS[7], ckey, concurrency)
local wi, wb = KEYS[4], KEYS[8]
local free = redis.call('EXISTS', wi, wb) == 0 and (limit < 0 or redis.call('ZCARD', KEYS[6]) < limit)
local rate = nil
if rate_limits ~= '' then
  local rpm, rps, tpm = string.match(rate_limits, '^(%S+) (%S+) (%S+)$')
  redis.call('HSET', KEYS[10], 'rpm', rpm, 'rps', rps, 'tpm', tpm)
  redis.call('SADD', KEYS[13], ckey)
  rate = rate_of(KEYS[10], KEYS[11], KEYS[12], ckey)
  if estimate ~= '0' then redis.call('HSET', KEYS[10], 'e:' .. call_id, estimate) end
end
local run = free and rate_admits(rate, call_id)  -- (a call the limiter holds back waits too)
local c, n, last
if not run then
  local depth = redis.call('ZCARD', wi)
  c = 'i'
  -- (batch calls count every call waiting, interactive ones their own: a batch never makes an agent's QueueFull)
  if klass == 'batch' then c, depth = 'b', depth + redis.call('ZCARD', wb) end
  local f = redis.call('HMGET', KEYS[9], 'n:' .. c .. ':' .. fkey, 'l:' .. c .. ':' .. fkey)
  n, last = tonumber(f[1]) or 0, tonumber(f[2])
  local no = nil
  if queue_size >= 0 and depth >= queue_size then
    no = {-1, depth}
  elseif key_size >= 0 and n >= key_size then
    no = {-3, n, key_size, fkey}
  end
  if no then
    if rate then redis.call('HDEL', KEYS[10], 'e:' .. call_id) end
    return no
  end
end
redis.call('HSET', KEYS[1], 'h_seq', '1', 'h_state', 'pending', 'status', 'queued', unpack(ARGV, FIELDS))
if run then
  redis.call('ZADD', KEYS[6], 'inf', call_id)
  redis.call('RPUSH', KEYS[2], call_id)
else
  fair_wait(KEYS[9], set_of(c, wi, wb), c, fkey, inc, '', tonumber(score), n, last, call_id, {'sh', share})
  -- slots free after the limit was raised
  if not free then promote(KEYS[6], wi, wb, KEYS[9], KEYS[2], limit, wake_channel, job_prefix, rate) end
end
if digest ~= '' then redis.call('SET', KEYS[5], call_id, 'EX', ttl) end
local ev = with_seq(event, 1)
redis.call('RPUSH', KEYS[3], ev)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
redis.call(publish, channel, ev)
return {1, call_id, run and 1 or 0}
