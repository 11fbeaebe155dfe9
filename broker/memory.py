"""Redis memory against ``maxmemory``: what ``status`` and the console show, and when they warn (at
``WARN_AT``, before new calls fail with ``BrokerFull``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

WARN_AT = 0.8  # the share of maxmemory past which status and the console warn


@dataclass(frozen=True)
class Memory:
    """Used memory and ``maxmemory`` in bytes (0: no limit), of the fullest node on a cluster."""

    used: int
    maxmemory: int
    policy: str = ""

    @property
    def fraction(self) -> float | None:
        """Used / maxmemory, None without a limit."""
        return self.used / self.maxmemory if self.maxmemory > 0 else None

    @property
    def warning(self) -> str | None:
        """A sentence when used memory is past ``WARN_AT`` of maxmemory, else None."""
        share = self.fraction
        if share is None or share < WARN_AT:
            return None
        return (
            f"Redis memory at {share:.0%} of maxmemory ({mib(self.used)} of {mib(self.maxmemory)}): at 100% new "
            "calls are refused (broker_full); raise maxmemory or lower workers.result_ttl"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fraction": self.fraction, "warning": self.warning}


def usage(conn: Any) -> Memory:
    """``INFO memory`` of ``conn``'s server (a cluster client: its fullest primary)."""
    info = conn.info("memory")
    nodes = info.values() if info and all(isinstance(v, dict) for v in info.values()) else [info]
    found = [
        Memory(
            used=_int(node.get("used_memory")),
            maxmemory=_int(node.get("maxmemory")),
            policy=str(node.get("maxmemory_policy") or ""),
        )
        for node in nodes
    ]
    return max(found, key=lambda m: (m.fraction or 0.0, m.used)) if found else Memory(0, 0)


def mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
