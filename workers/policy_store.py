"""The active policy in Redis: pushed once, read by every worker, changed without a restart.

``hermes:policy`` is a hash (``data`` = ``Policy.encode()``, ``digest``, ``version``, ``pushed_at``,
``source``). A push bumps ``version`` and publishes it on ``hermes:policy:changes`` in one script, so
a worker that sees the notice always finds the new policy. With nothing stored, ``config.yaml``'s
``policy:`` is the policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from broker import keys, scripts
from broker.codec import text
from workers.policy import Policy


@dataclass(frozen=True)
class Stored:
    """The policy in Redis and its bookkeeping; ``policy`` is None once cleared."""

    policy: Policy | None
    version: int
    pushed_at: float = 0.0
    source: str = ""


def push(conn: Any, policy: Policy, source: str = "") -> tuple[int, bool]:
    """Make ``policy`` the active one for every worker; returns ``(version, changed)``."""
    script = conn.register_script(scripts.POLICY_PUSH)
    version, changed = script(
        keys=[keys.POLICY],
        args=[
            policy.encode(),
            policy.digest(),
            repr(time.time()),
            source,
            keys.channel(conn, keys.POLICY_CHANNEL),
        ],
    )
    return int(version), bool(changed)


def clear(conn: Any) -> int:
    """Drop the stored policy (workers fall back to their config.yaml); returns the new version, 0 if none."""
    channel = keys.channel(conn, keys.POLICY_CHANNEL)
    return int(conn.register_script(scripts.POLICY_CLEAR)(keys=[keys.POLICY], args=[channel]))


def load(conn: Any) -> Stored:
    """The stored policy; raises DecodeError when what is stored is not a valid policy."""
    fields = {text(k): v for k, v in conn.hgetall(keys.POLICY).items()}
    ver = int(fields.get("version") or 0)
    data = fields.get("data")
    if data is None:
        return Stored(None, ver)
    return Stored(Policy.decode(data), ver, float(fields.get("pushed_at") or 0), text(fields.get("source")))


def active(conn: Any, fallback: Policy) -> tuple[Policy, int]:
    """The policy calls are judged by: the stored one, else ``fallback`` (config.yaml's); with its version."""
    stored = load(conn)
    return (stored.policy if stored.policy is not None else fallback), stored.version
