"""Idempotency keys: what a call asks for as a digest (SUBMIT stores and compares it), and the conflict
when a key is reused for another call."""

from __future__ import annotations

from broker import keys
from broker.logs import HASH_PREFIX, hash_value

from .envelope import Envelope
from .errors import IdempotencyConflict


def request_digest(env: Envelope) -> str:
    """What a call asks for, as a digest: kind, tool (or model), args (or LLM request) and the principal
    when it names one (alice reusing a key of admin's is a conflict, never admin's result); not the rest of
    the context, options or trace headers, which a resubmission may change."""
    body = env.args if env.kind == "tool" else env.request
    principal = env.context.get("principal")
    what = [env.kind, env.name, body] + ([principal] if principal else [])  # principal-less: digests as before
    return hash_value(what).removeprefix(HASH_PREFIX)[:32]


def key_name(env: Envelope) -> str:
    """Where the call's idempotency key names its call: per queue tag and per principal, whose keys are its
    own (another's same string neither blocks it nor tells whether it was used); a principal-less key as before."""
    key, principal = env.options.idempotency_key or "", env.context.get("principal")
    return keys.idempotency(keys.tag(env.queue), f"{key}\0{principal}" if principal else key)


def conflict(env: Envelope | None, call_id: str, name: str, kind: str) -> IdempotencyConflict:
    key = env.options.idempotency_key if env is not None else None
    what = "model" if kind == "llm" else "tool"
    if env is not None and (env.name, env.kind) != (name, kind):
        asked = "model" if env.kind == "llm" else "tool"
        why = f": it cannot be reused for {asked} {env.name!r}"
    else:
        other = "a different request" if kind == "llm" else "different arguments"
        why = f" with {other}: reuse a key only to resubmit the same call"
    return IdempotencyConflict(
        f"idempotency key {key!r} already belongs to call {call_id} of {what} {name!r}{why}",
        key=key,
        call_id=call_id,
        tool=name,
        kind=kind,
    )
