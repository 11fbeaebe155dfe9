"""The worker's call counts (its heartbeat reports them) and the fleet's list of recent failures
(``hermes:failures``, the last ``FAILURES_KEPT``), written with the failed call's terminal move."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from broker import keys
from broker.codec import pack
from workers.hooks.hook import Hook, Writer

if TYPE_CHECKING:
    from workers.runner import Running

FAILURES_KEPT = 100


class Failures(Hook):
    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        core = self.core
        core.processed += 1
        if state != "failed":
            return None
        core.failed += 1
        entry = pack(
            {
                "call_id": run.info.call_id,
                "name": run.info.name,
                "kind": run.info.kind,
                "error": error or {},
                "ts": time.time(),
                "worker": core.name,
                # (the API shows a non-admin token its own principal's failures only)
                "principal": run.env.context.get("principal") if run.env is not None else None,
            }
        )

        def write(pipe: Any) -> None:
            pipe.lpush(keys.FAILURES, entry)
            pipe.ltrim(keys.FAILURES, 0, FAILURES_KEPT - 1)

        return write
