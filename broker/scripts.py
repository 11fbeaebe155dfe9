"""The Lua scripts, one per file in ``broker/lua/``, each read once at import.

Each file starts with a header saying its KEYS and ARGV; arguments are named locals. Every key a script
touches is passed in KEYS (built by ``broker.keys``), except the records of call ids a script discovers
(CLAIM, REAP, DUE, SWEEP, an idempotency key's call in SUBMIT) and a call's idempotency key named in its
record: those are read at a prefix given in ARGV, and live in the same slot because a call id carries its
queue's hash tag. Library files (``with_seq``, ``ratelimit``, ``slots``) are prepended to the scripts that use them.
"""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).with_name("lua")


def load(name: str, *libs: str) -> str:
    """The text of ``lua/<name>.lua`` after the library files ``libs``."""
    return "\n".join((_DIR / f"{part}.lua").read_text() for part in (*libs, name))


SUBMIT = load("submit", "with_seq", "ratelimit", "slots")
TRANSITION = load("transition", "with_seq", "ratelimit", "slots")
CLAIM = load("claim")
TAKE_DUE = load("take_due")  # REAP and DUE
SWEEP = load("sweep", "ratelimit", "slots")
RATE_SENT = load("rate_sent", "ratelimit")
RATE_PAUSE = load("rate_pause", "ratelimit")
RATE_DUE = load("rate_due")
RATE_PROMOTE = load("rate_promote", "ratelimit", "slots")
REQUEUE = load("requeue")
BREAKER_CHECK = load("breaker_check")
BREAKER_RECORD = load("breaker_record")
AUDIT_APPEND = load("audit_append")
TOOL_REGISTER = load("tool_register")
POLICY_PUSH = load("policy_push")
POLICY_CLEAR = load("policy_clear")

# The scripts sent inside pipelines (a cluster client loads them on every primary up front).
PIPELINED = (SUBMIT, TRANSITION, REQUEUE, AUDIT_APPEND, RATE_SENT)
