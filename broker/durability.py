"""Confirmed submissions: ``broker.wait_replicas: N`` makes a write wait for ``WAIT N timeout``.

Redis replicates asynchronously: a failover may lose a primary's last writes. Short of N replicas within
``broker.wait_timeout_ms`` the caller is told (``BrokerNotDurable``) instead of holding a call it may lose.
"""

from __future__ import annotations

import time
from typing import Any

from .config import Settings
from .connection import is_cluster
from .errors import BrokerNotDurable, ConfigError


def check_supported(conn: Any, settings: Settings) -> None:
    """ConfigError when ``broker.wait_replicas`` is asked of a Redis Cluster: WAIT confirms the writes of
    one connection to one node, and a cluster client's writes of one call go to several."""
    if settings.broker.wait_replicas > 0 and is_cluster(conn):
        raise ConfigError(
            f"broker.wait_replicas ({settings.broker.wait_replicas}; env HERMES_WAIT_REPLICAS) is not supported on a "
            "Redis Cluster: use it with a single or Sentinel-managed primary, or set it to 0"
        )


def queue_wait(pipe: Any, settings: Settings) -> bool:
    """Queue ``WAIT`` behind the writes in ``pipe`` when the settings ask for it; whether it was queued."""
    if settings.broker.wait_replicas <= 0:
        return False
    pipe.execute_command("WAIT", settings.broker.wait_replicas, settings.broker.wait_timeout_ms)
    return True


def shortfall(acked: Any, settings: Settings, what: str, **details: Any) -> BrokerNotDurable | None:
    """The error to raise when ``acked`` (WAIT's reply, or the error in its place) falls short, else None."""
    wanted = settings.broker.wait_replicas
    if not isinstance(acked, Exception) and int(acked) >= wanted:
        return None
    got = "an error: " + str(acked) if isinstance(acked, Exception) else f"{int(acked)} of {wanted} replica(s)"
    return BrokerNotDurable(
        f"{what}: the broker confirmed it on {got} within {settings.broker.wait_timeout_ms} ms "
        f"(broker.wait_replicas: {wanted})",
        replicas=0 if isinstance(acked, Exception) else int(acked),
        wanted=wanted,
        **details,
    )


class Confirmer:
    """A worker's WAITs: while the replicas fall short it stops asking for ``SKIP`` seconds, so a worker does
    not crawl at one ``wait_timeout_ms`` per write when no replica is left."""

    SKIP = 5.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._skip_until = 0.0

    @property
    def asked(self) -> bool:
        """Whether ``broker.wait_replicas`` asks for WAITs at all."""
        return self.settings.broker.wait_replicas > 0

    def wanted(self) -> bool:
        """Whether to WAIT now: asked for, and not backing off."""
        return self.asked and time.monotonic() >= self._skip_until

    def queue(self, pipe: Any) -> bool:
        """Queue WAIT behind ``pipe``'s writes when :meth:`wanted`; whether it was queued."""
        return self.wanted() and queue_wait(pipe, self.settings)

    def check(self, acked: Any, what: str) -> BrokerNotDurable | None:
        """The shortfall of a WAIT reply (and then back off), else None."""
        short = shortfall(acked, self.settings, what)
        if short is not None:
            self._skip_until = time.monotonic() + self.SKIP
        return short
