-- AUDIT_KEY: the deployment's secret for the keyed hashes of sensitive arguments (broker/audit.py,
-- AuditLog.digest), made once by whichever process needs it first; allow-oom (broker/scripts.py), so a
-- worker ending calls at maxmemory still reads it.
-- KEYS: 1 the secret's key (<audit stream>:key)
-- ARGV: 1 a new random secret, kept only when none is there yet. Returns the secret kept.
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
