-- TOOL_REGISTER: add or update a tool in the directory (keys of the {hermes:dir} tag). Check and write
-- are one script, so two writers cannot interleave.
-- KEYS: 1 tools hash, 2 version counter, 3 digests hash, 4 versions hash
-- ARGV: see the locals below
-- Returns {version, outcome}: 0 unchanged (identical spec: a no-op), 1 added, 2 updated, 3 kept (a
-- different spec is there and replace is 0).
local name = ARGV[1]
local digest = ARGV[2]
local spec = ARGV[3]            -- the packed spec
local channel = ARGV[4]
local replace = ARGV[5]         -- '0' / '1'
local cur = redis.call('HGET', KEYS[1], name)
if cur then
  local d = redis.call('HGET', KEYS[3], name)
  local ver = tonumber(redis.call('HGET', KEYS[4], name)) or 0  -- (a damaged version reads as 0)
  if d == digest then
    return {ver, 0}
  end
  if replace == '0' then
    return {ver, 3}
  end
end
local v = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], name, spec)
redis.call('HSET', KEYS[3], name, digest)
redis.call('HSET', KEYS[4], name, v)
redis.call('PUBLISH', channel, name)
if cur then
  return {v, 2}
end
return {v, 1}
