-- TRANSITION: move a call (or record a non-state event), atomically with its events (uses with_seq,
-- ratelimit, slots, claiming).
-- KEYS: 1 job hash, 2 history list, 3 leases zset, 4 interactive waiting zset, 5 slots zset (of the
--       call's concurrency key), 6 limits hash, 7 scheduled zset, 8 queue list, 9 batch waiting zset,
--       10 fair-state hash, 11 rate limiter hash, 12 its log (4, 5, 9-12 of the call's concurrency key),
--       13 the rate timer zset, 14 the ended call's kept terminal event (a string) — all of the call's
--       queue tag
-- ARGV: see the locals below; then `before` earlier event payloads (moves the call made since its last
--       write, recorded and published in order first), then field/value pairs for the job hash
-- Returns {seq, state before}; seq < 0: -1 no such call, -2 attempt fence, -3 wrong source state. With
-- `take` (ARGV 23-30), a release also returns the calls it took: {seq, state before, {call_id, data,
-- attempt, ...}, {absent id, ...}}, as CLAIM does.
-- Ending with a ttl also expires the call's idempotency key (named in its record's `h_idem`: a key of
-- the same tag, so of this slot) while it still names this call. The records of the calls promote pops
-- are read at job_prefix .. id (their fairness key; same tag, same slot).
-- Ending a batch's call (its record's `h_batch` = "<ttl> <index> <prefix>", a prefix of the same tag) also
-- writes its result into the batch: the terminal event at <prefix>:r[index] once (HSETNX), then the index
-- on <prefix>:o (completion order) and a count of the state in <prefix>:n.
-- Ending (a ttl) also shrinks what the call keeps for that ttl (see ENDED below): the history list goes
-- and the terminal event alone stays, a string at KEYS[14] (what a late follower gets: its state, result
-- or error, trace id, seq; stored with `steps`, the earlier moves' times; a string costs ~150 bytes less
-- than a one-event list), and the job hash is written anew with only the
-- fields in ENDED that it has, small values that Redis keeps as a listpack (the `data` of the
-- submission had made it a hash table, which deleting fields would not undo).
-- Runs at maxmemory (`allow-oom`, added by broker/scripts.py on Redis 7): an accepted call can always
-- move and end, and ending frees memory; new calls are refused at SUBMIT instead.
local call_id = ARGV[1]
local event = ARGV[2]
local ttl = ARGV[3]             -- '' = leave the TTL
local fence = ARGV[4]           -- the attempt the writer holds ('' = none)
local sources = ARGV[5]         -- '' any non-terminal, '*' anything, 'pending!' pending and not leased, else a,b,c
local state = ARGV[6]           -- new state ('' = no change)
local rq_status = ARGV[7]
local lease = ARGV[8]           -- '' keep, '-' drop, else the new deadline
local requeue = ARGV[9]         -- '1' = admit it again (a free slot, else waiting at `score`)
local score = ARGV[10]          -- '' = its fairness key's next turn, 'first' = before every waiting call
local channel = ARGV[11]
local release = ARGV[12]        -- '1' = give its slot back
local ckey = ARGV[13]
local due = ARGV[14]            -- when a retry is due ('' = not scheduled)
local wake_channel = ARGV[15]
local publish = ARGV[16]        -- PUBLISH, or SPUBLISH on a cluster
local job_prefix = ARGV[17]
local now = ARGV[18]            -- µs (the fair clock's start, when nobody waited)
local used = ARGV[19]           -- tokens the call used, settled with its rate limiter ('' its estimate, '-' never sent)
local keep_history = ARGV[20]   -- '1' = an ended call keeps every event (workers.keep_history)
local moves = ARGV[21]          -- the earlier events' transitions, a step each (broker.calls.step_text; the record's h_steps)
local move = ARGV[22]           -- this event's, '' when it is no transition
-- A worker ending the call (with `release`) takes the next calls of its queue in the same script, the
-- ones its promote just put there first: `take` of them ('' = none; it holds a free slot of its own for
-- each), leased to `worker` until `deadline` (claiming's claim_calls; they come back as the reply's third
-- and fourth entries). The wake-up goes out only if calls are left on the queue for other workers.
-- A worker takes only while it holds less than its share of the key's limit (`held` other calls of the
-- key, `peers` workers on the queue: held * peers < limit), so the slots of a busy key go round the
-- workers rather than staying with the first; past its share, the slot goes back with a wake-up.
local asked = ARGV[23] ~= ''
local take = tonumber(ARGV[23]) or 0
local worker, deadline, started_at = ARGV[24], ARGV[25], ARGV[26]
local slots_prefix, id_prefix = ARGV[27], ARGV[28]
local held, peers = tonumber(ARGV[29]) or 0, tonumber(ARGV[30]) or 1
local before = tonumber(ARGV[31])
local EARLY = 32
local FIELDS = EARLY + before
-- What an ended call's hash keeps (broker/calls.py reads the rest from its terminal event): state and
-- attempt (scripts, the record), RQ's status, kind and tool (handles by id, idempotent resubmissions),
-- the idempotency key and digest, a result too large for the done event, and an LLM call's `data` (the
-- messages its model was sent: `events --request` and the console show them, the seed's "was the tool
-- result fed back?"; a tool call's arguments are in its audit record). Each byte counts: the hash stays
-- a listpack in a small allocation (created_at or worker_name would each take it a size class up).
local ENDED = {'h_state', 'h_attempt', 'status', 'h_kind', 'h_tool', 'h_idem', 'h_digest', 'h_result', 'h_principal'}
local KIND = 4  -- (an LLM call's `data` is kept too, read apart: see below)

local rec = redis.call('HMGET', KEYS[1], 'h_state', 'h_attempt', 'h_idem', 'h_batch', 'h_steps', 'h_seq')
local st = rec[1]
if not st then return {-1, ''} end
if fence ~= '' and rec[2] ~= fence then return {-2, st} end
if sources == '' then
  if st == 'done' or st == 'failed' or st == 'cancelled' then return {-3, st} end
elseif sources == 'pending!' then  -- pending and taken by no worker (a caller cancelling it directly)
  if st ~= 'pending' or redis.call('ZSCORE', KEYS[3], call_id) then return {-3, st} end
elseif sources ~= '*' then
  if not string.find(',' .. sources .. ',', ',' .. st .. ',', 1, true) then return {-3, st} end
end
-- The idempotency key is read before the first write: a key this node no longer serves (its slot is
-- migrating) fails the script here, before it changed anything, so the writer sends it again whole.
local idem_ours = ttl ~= '' and rec[3] and redis.call('GET', rec[3]) == call_id
-- So are a batch's result keys (same tag): is this index's result still to be written?
local bttl, bindex, bkey
local batch_new = false
if rec[4] and (state == 'done' or state == 'failed' or state == 'cancelled') then
  bttl, bindex, bkey = string.match(rec[4], '^(%d+) (%d+) (.+)$')
  batch_new = bkey ~= nil and redis.call('HEXISTS', bkey .. ':r', bindex) == 0
  if batch_new then redis.call('EXISTS', bkey .. ':x', bkey .. ':o', bkey .. ':n') end
end
-- One increment for every event this call records: the earlier ones get seq .. seq + before - 1. (An
-- ending that trims the record writes it anew without h_seq below: its count is read, not written.)
local trims = ttl ~= '' and keep_history ~= '1'
local seq
if trims then
  seq = (tonumber(rec[6]) or 0) + 1
else
  seq = redis.call('HINCRBY', KEYS[1], 'h_seq', before + 1) - before
end
-- This write's steps follow '#' and the seq of its first event (broker.calls.step_text).
local mark = '#' .. seq
local steps_so_far = rec[5] or ''
if moves ~= '' then steps_so_far = steps_so_far .. mark .. moves end
if state ~= '' then
  if move ~= '' and ttl == '' then  -- (an ended call's hash is written anew below, without them)
    if moves == '' then move = mark .. move end
    redis.call('HSET', KEYS[1], 'h_state', state, 'status', rq_status, 'h_steps', steps_so_far .. move,
               unpack(ARGV, FIELDS, #ARGV))
  else
    redis.call('HSET', KEYS[1], 'h_state', state, 'status', rq_status, unpack(ARGV, FIELDS, #ARGV))
  end
elseif #ARGV >= FIELDS then
  redis.call('HSET', KEYS[1], unpack(ARGV, FIELDS, #ARGV))
end
local leased = false  -- (a call claimed off the queue holds a slot: it does not wait)
if lease == '-' then
  leased = redis.call('ZREM', KEYS[3], call_id) == 1
elseif lease ~= '' then
  redis.call('ZADD', KEYS[3], lease, call_id)
end
local rate = nil
local woken = false  -- this release promoted calls onto the queue (their wake-up waits for the take)
if release == '1' or requeue == '1' then rate = rate_of(KEYS[11], KEYS[12], KEYS[13], ckey) end
if release == '1' then
  if st == 'pending' and not leased then  -- (only a pending call waits)
    unwait(KEYS[4], KEYS[9], KEYS[10], call_id, KEYS[1])
  end
  rate_settle(rate, call_id, used, state == 'done' or state == 'failed' or state == 'cancelled')
  if redis.call('ZREM', KEYS[5], call_id) == 1 then
    local limit = limit_of(KEYS[6], ckey)
    if take > 0 and limit >= 0 and held * peers >= limit then take = 0 end
    local channel_now = wake_channel
    if take > 0 then channel_now = '' end
    woken = promote(KEYS[5], KEYS[4], KEYS[9], KEYS[10], KEYS[8], limit, channel_now, job_prefix, rate)
  end
end
if due ~= '' then
  redis.call('ZADD', KEYS[7], due, call_id)
end
if requeue == '1' then
  redis.call('ZREM', KEYS[7], call_id)
  local f = redis.call('HMGET', KEYS[1], 'h_fkey', 'h_class')
  admit(KEYS[5], KEYS[4], KEYS[9], KEYS[10], KEYS[8], limit_of(KEYS[6], ckey), call_id, score, wake_channel,
        job_prefix, f[1] or '', f[2], tonumber(now), rate)
end
-- Every event in order: one append to the history, one message each on the caller's channel.
local stored = {}
for i = EARLY, FIELDS - 1 do
  local early = with_seq(ARGV[i], seq)
  stored[#stored + 1] = early
  redis.call(publish, channel, early)
  seq = seq + 1
end
local ev = with_seq(event, seq)
if not trims then
  stored[#stored + 1] = ev
  redis.call('RPUSH', KEYS[2], unpack(stored))
end
if ttl ~= '' and keep_history == '1' then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
  if idem_ours then redis.call('EXPIRE', rec[3], ttl) end
elseif trims then
  local kept = redis.call('HMGET', KEYS[1], unpack(ENDED))
  local fields = {}
  for i, name in ipairs(ENDED) do
    if kept[i] then
      fields[#fields + 1] = name
      fields[#fields + 1] = kept[i]
    end
  end
  if kept[KIND] == 'llm' then  -- (a tool call's `data` is dropped: it is not even read out)
    local data = redis.call('HGET', KEYS[1], 'data')
    if data then
      fields[#fields + 1] = 'data'
      fields[#fields + 1] = data
    end
  end
  -- The events it drops leave their moves on the one it keeps: `steps`, the record's h_steps and
  -- `moves` as they are (a step for each earlier transition, a msgpack str), from which the
  -- console draws an ended call's waterfall (broker.events reads them as µs before the end): no event
  -- decoded, nothing parsed here.
  -- It also leaves out its call id, the payload's first entry ("call_id", then a str of the id): its key
  -- names the call, and broker.events.decode takes the id from there (48 bytes of the 800 a call keeps).
  local count, from = string.byte(ev, 1), 2  -- the fixmap's entries; where they start
  local idn = #call_id
  local id_head = (idn < 32 and 1) or (idn < 256 and 2) or 0
  if id_head > 0 and string.sub(ev, 2, 9) == '\167call_id' then
    count, from = count - 1, 10 + id_head + idn
  end
  local kept_ev = ev
  local n = #steps_so_far
  if n > 0 then
    local head
    if n < 32 then
      head = string.char(160 + n)
    elseif n < 256 then
      head = string.char(217, n)
    elseif n < 65536 then
      head = string.char(218, math.floor(n / 256), n % 256)
    else
      head = string.char(219, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
                         math.floor(n / 256) % 256, n % 256)
    end
    kept_ev = string.char(count + 1) .. string.sub(ev, from) .. '\165steps' .. head .. steps_so_far
  elseif from > 2 then
    kept_ev = string.char(count) .. string.sub(ev, from)
  end
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('SET', KEYS[14], kept_ev, 'EX', ttl)
  if idem_ours then redis.call('EXPIRE', rec[3], ttl) end
end
-- A batch's result: written once per index, whoever ends the call (worker, reaper, a caller's cancel).
if batch_new then
  redis.call('HSET', bkey .. ':r', bindex, ev)
  local big = redis.call('HGET', KEYS[1], 'h_result')  -- a result too large for its event
  if big then redis.call('HSET', bkey .. ':x', bindex, big) end
  redis.call('RPUSH', bkey .. ':o', bindex)
  redis.call('HINCRBY', bkey .. ':n', state, 1)
  for _, part in ipairs({':r', ':x', ':o', ':n'}) do redis.call('EXPIRE', bkey .. part, bttl) end
end
redis.call(publish, channel, ev)
if asked and release == '1' then
  if take == 0 then return {seq, st, {}, {}} end
  local claimed = claim_calls(KEYS[3], KEYS[8], take, worker, deadline, started_at, job_prefix, slots_prefix, id_prefix)
  if woken and redis.call('LLEN', KEYS[8]) > 0 then redis.call('PUBLISH', wake_channel, '') end
  return {seq, st, claimed[1], claimed[2]}
end
return {seq, st}
