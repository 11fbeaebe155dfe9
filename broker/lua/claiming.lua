-- Library (prepended to CLAIM, and to TRANSITION: a worker ending a call takes the next one in the same
-- script, broker/lua/transition.lua's `take`).
-- claim_calls: take up to `max` pending calls off one queue (`queue` list, `leases` zset: one queue tag),
-- leased to `worker` until `deadline`. Returns {{call_id, data, attempt, ...}, {absent id, ...}}. A call's
-- slot score becomes its lease deadline. Calls no longer pending (cancelled) are dropped from the queue;
-- their slot went back when they ended.
-- An id whose record is not here is returned as absent: on a cluster its record may be on the way to
-- another node (a slot migration: MIGRATE moves key by key), so the caller asks again where redirections
-- are followed and puts it back, or drops it when it is gone (expired). A record (or slot set) this node
-- no longer serves (the migration has moved it already: a call would fail as "non local key") ends the
-- claim there, the id back at the head, so a migration never leaves a call popped but not handed out.
-- The ids popped are discovered here: their records are read at job_prefix .. id and their slot sets at
-- slots_prefix .. concurrency key (ids and keys carry the queue's tag, so all of them live in this slot).
-- On a cluster an id that does not start with `id_prefix` (the queue's tag and a dot; '' on one Redis)
-- is no call of this queue: it is returned as absent without a lookup (its record would be another
-- slot's key, and the script would fail after its pops).
local function claim_calls(leases, queue, max, worker, deadline, started_at, job_prefix, slots_prefix, id_prefix)
  local out = {}
  local absent = {}
  local got = 0
  while got < max do
    local id = redis.call('LPOP', queue)
    if not id then break end
    local job = job_prefix .. id
    local f = {}
    local held = false
    if string.sub(id, 1, #id_prefix) == id_prefix then
      f = redis.pcall('HMGET', job, 'h_state', 'h_ckey', 'data', 'h_attempt')
      held = not f.err and f[1] == 'pending' and f[2] and redis.pcall('ZADD', slots_prefix .. f[2], 'XX', deadline, id)
    end
    if f.err or (type(held) == 'table' and held.err) then
      -- A key of this call already left for another node (its slot is migrating): the id goes back at
      -- the head and nothing more is claimed here this time (no write was made for it).
      redis.call('LPUSH', queue, id)
      break
    end
    if f[1] == 'pending' then
      redis.call('HSET', job, 'h_worker', worker, 'worker_name', worker, 'started_at', started_at)
      redis.call('ZADD', leases, deadline, id)
      out[#out + 1] = id
      out[#out + 1] = f[3]
      out[#out + 1] = f[4]
      got = got + 1
    elseif not f[1] then
      absent[#absent + 1] = id
    end
  end
  return {out, absent}
end
