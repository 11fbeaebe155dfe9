-- CLAIM: take up to `max` pending calls off one queue, leased to a worker (uses claiming: claim_calls
-- says how, and what comes back).
-- KEYS: 1 leases zset, 2 queue list (of one queue tag)
-- ARGV: max, worker, lease deadline, started_at, slots_prefix, id_prefix, job_prefix
-- Returns {{call_id, data, attempt, ...}, {absent id, ...}}.
return claim_calls(KEYS[1], KEYS[2], tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], ARGV[7], ARGV[5], ARGV[6])
