"""Circuit breakers shared by every worker: state in one Redis hash per key, every change one Lua script.

``closed`` lets calls through and counts failures (consecutive, and/or an error rate over a window with a
minimum of calls); past the threshold it turns ``open``: calls fail at once with ``circuit_open``. After
the cooldown the first caller turns it ``half_open`` and is its only probe; the probe's outcome closes it
or opens it again. A probe whose worker died is replaced once its deadline passes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import redis
from redis.client import Pipeline

from . import keys, scripts
from .codec import pack, text
from .connection import is_cluster
from .toolspec import ToolSpec

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

# Error types that count as a failure of the back end unless a breaker lists its own (``on``).
COUNTED = frozenset(
    {"executor_error", "tool_timeout", "provider_error", "provider_timeout", "internal_error"}
)


@dataclass(frozen=True)
class BreakerConfig:
    """A breaker's rules: ``breaker: {failures, cooldown, rate, window, min_calls, key, on}``."""

    key: str
    failures: int = 5
    cooldown: float = 30.0
    rate: float = 0.0
    window: float = 60.0
    min_calls: int = 20
    on: frozenset[str] = COUNTED

    @classmethod
    def of(cls, cfg: dict[str, Any], default_key: str) -> BreakerConfig:
        on = cfg.get("on")
        return cls(
            key=str(cfg.get("key") or default_key),
            # With only the error-rate rule written, the consecutive rule stays off.
            failures=int(cfg.get("failures", 0 if "rate" in cfg else 5)),
            cooldown=float(cfg.get("cooldown", 30.0)),
            rate=float(cfg.get("rate", 0.0)),
            window=float(cfg.get("window", 60.0)),
            min_calls=int(cfg.get("min_calls", 20)),
            on=frozenset([on] if isinstance(on, str) else on) if on is not None else COUNTED,
        )

    def counts(self, error_type: str) -> bool:
        """Whether an error of this type is a failure of the back end (timeouts, 5xx), not the caller's."""
        return error_type in self.on


def breaker_config(settings: Any, spec: ToolSpec) -> BreakerConfig | None:
    """Which breaker guards a tool: its ``breaker:`` over ``executors.<type>.breaker``; None for neither."""
    base = settings.executor_settings(spec.executor).get("breaker")
    base = base if isinstance(base, dict) else None
    if not spec.breaker and base is None:
        return None
    return BreakerConfig.of({**(base or {}), **(spec.breaker or {})}, f"tool:{spec.name}")


@dataclass(frozen=True)
class Change:
    """One state change of one breaker."""

    key: str
    previous: str
    state: str
    reason: str
    call_id: str
    ts: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    """What a breaker said to one call: go (``probe`` when it is the half-open probe) or fail at once."""

    allowed: bool
    probe: bool
    retry_at: float | None
    change: Change | None


class Breakers:
    """Scripted operations on circuit breakers."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._check = conn.register_script(scripts.BREAKER_CHECK)
        self._record = conn.register_script(scripts.BREAKER_RECORD)
        self.channel = keys.channel(conn, keys.BREAKER_CHANNEL)

    def check(self, cfg: BreakerConfig, call_id: str, probe_ttl: float) -> Decision:
        """May this call go to the back end? The first call after the cooldown becomes the probe."""
        now = time.time()
        decision, before, retry_at = (
            text(v)
            for v in self._check(
                keys=[keys.breaker(cfg.key), keys.BREAKERS],
                args=[now, cfg.cooldown, call_id, now + probe_ttl, cfg.key],
            )
        )
        change = None
        if decision == "probe" and before == OPEN:
            change = Change(cfg.key, OPEN, HALF_OPEN, "cooldown over: one probe call", call_id, now)
        return Decision(
            decision != "reject", decision == "probe", float(retry_at) if retry_at else None, change
        )

    def record(self, cfg: BreakerConfig, call_id: str, outcome: str, error_type: str = "") -> Change | None:
        """Count one outcome (``ok``, ``fail`` or ``neutral``); returns the change it caused, if any."""
        now = time.time()
        after, before, reason = (
            text(v)
            for v in self._record(
                keys=[keys.breaker(cfg.key), keys.BREAKER_WINDOW.format(cfg.key), keys.BREAKERS],
                args=[
                    now, outcome, call_id, cfg.failures, cfg.rate, cfg.window, cfg.min_calls, error_type,
                    cfg.key,
                ],
            )
        )
        if after == before:
            return None
        return Change(cfg.key, before, after, reason, call_id, now)

    def publish(self, change: Change, pipeline: Pipeline | None = None) -> None:
        """Announce a change on the breaker channel (in ``pipeline``, except on a cluster: its pipelines
        carry no PUBLISH)."""
        target = pipeline if pipeline is not None and not is_cluster(self.conn) else self.conn
        target.publish(self.channel, pack(change.to_dict()))

    def state(self, key: str) -> dict[str, Any]:
        """One breaker's state (``closed`` when it never tripped)."""
        return _view(key, self.conn.hgetall(keys.breaker(key)))

    def all(self) -> list[dict[str, Any]]:
        """Every breaker that ever changed state, with its current state."""
        names = sorted(text(k) for k in self.conn.smembers(keys.BREAKERS))
        pipe = self.conn.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(keys.breaker(name))
        return [_view(name, raw) for name, raw in zip(names, pipe.execute(), strict=True)]

    def reset(self, key: str) -> None:
        """Forget a breaker (closed again, counters cleared)."""
        self.conn.delete(keys.breaker(key), keys.BREAKER_WINDOW.format(key))
        self.conn.srem(keys.BREAKERS, key)


def _view(key: str, stored: dict[Any, Any]) -> dict[str, Any]:
    raw = {text(k): text(v) for k, v in stored.items()}
    state = raw.get("state") or CLOSED
    out: dict[str, Any] = {
        "key": key,
        "state": state,
        "failures": int(raw.get("failures") or 0),
        "reason": raw.get("reason") or "",
        "last_error": raw.get("last_error") or "",
        "changed_at": float(raw.get("changed_at") or 0) or None,
    }
    if state == OPEN:
        out["opened_at"] = float(raw.get("opened_at") or 0)
    if state == HALF_OPEN:
        out["probe"] = raw.get("probe") or None
    return out


def rejecting(view: dict[str, Any], cooldown: float, now: float | None = None) -> bool:
    """Whether a breaker in this state would refuse a call now (open, cooldown not over)."""
    if view.get("state") != OPEN:
        return False
    return (time.time() if now is None else now) < float(view.get("opened_at") or 0) + cooldown
