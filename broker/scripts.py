"""The Lua scripts, one per file in ``broker/lua/`` (each with a KEYS/ARGV header), read once at import.

Every key a script touches is passed in KEYS, except the records of call ids a script discovers and a
call's idempotency key named in its record: those are read at a prefix given in ARGV, in the same slot (a
call id carries its queue's hash tag). Library files are prepended to the scripts that use them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_DIR = Path(__file__).with_name("lua")


def load(name: str, *libs: str) -> str:
    """The text of ``lua/<name>.lua`` after the library files ``libs``."""
    return "\n".join((_DIR / f"{part}.lua").read_text() for part in (*libs, name))


# Script flags (Redis 7): a script so flagged runs past maxmemory. TRANSITION has it, so accepted calls
# move and end (freeing memory), and AUDIT_APPEND, so each ended call gets its audit record; SUBMIT has
# not, so new calls are refused there (``BrokerFull``).
ALLOW_OOM = "#!lua flags=allow-oom\n"

SUBMIT = load("submit", "with_seq", "ratelimit", "slots")
TRANSITION = ALLOW_OOM + load("transition", "with_seq", "ratelimit", "slots", "claiming")
CLAIM = load("claim", "claiming")
TAKE_DUE = load("take_due")  # REAP and DUE
SWEEP = load("sweep", "ratelimit", "slots")
RATE_SENT = load("rate_sent", "ratelimit")
RATE_PAUSE = load("rate_pause", "ratelimit")
RATE_AGAIN = load("rate_again", "ratelimit")
RATE_DUE = load("rate_due")
RATE_PROMOTE = load("rate_promote", "ratelimit", "slots")
BREAKER_CHECK = load("breaker_check")
BREAKER_RECORD = load("breaker_record")
AUDIT_APPEND = ALLOW_OOM + load("audit_append")  # (an ended call's record, written with its end)
# The audit's keyed-hash secret, made once: at maxmemory too (a worker ending a call with sensitive arguments reads it).
AUDIT_KEY = ALLOW_OOM + load("audit_key")
TOOL_REGISTER = load("tool_register")
POLICY_PUSH = load("policy_push")
POLICY_CLEAR = load("policy_clear")
STATS_NAME = load("stats_name")
BATCH_STATE = load("batch_state")
BATCH_UNSENT = load("batch_unsent")

# The scripts sent inside pipelines (a cluster client loads them on every primary up front).
PIPELINED = (SUBMIT, TRANSITION, AUDIT_APPEND, RATE_SENT)


_FLAGS: dict[int, bool] = {}  # id of a connection pool -> whether its server takes script flags


def for_server(conn: Any, text: str) -> str:
    """``text`` as ``conn``'s server takes it: a flags line (``#!lua ...``) needs Redis 7, so an older
    server (the embedded broker is 6.2), fakeredis and an asyncio client get the script without it."""
    if not text.startswith("#!") or takes_flags(conn):
        return text
    return text.split("\n", 1)[1]


def takes_flags(conn: Any) -> bool:
    """Whether ``conn``'s server runs scripts with flags (Redis 7+; a cluster is always; an asyncio client
    is not asked synchronously), asked once per connection pool."""
    import redis.cluster

    if isinstance(conn, redis.cluster.RedisCluster) or type(conn).__name__ == "RedisCluster":
        return True
    if type(conn).__module__.startswith(("fakeredis", "redis.asyncio")):
        return False
    pool = getattr(conn, "connection_pool", None)
    known = _FLAGS.get(id(pool))
    if known is None:
        try:
            version = str(conn.info("server").get("redis_version", "0"))
        except redis.RedisError:  # (unreachable now: no flags this time)
            return False
        known = _FLAGS[id(pool)] = int(version.split(".")[0] or 0) >= 7
    return known
