"""A call's token usage: counted for the stats flush, and an LLM call's tokens added to its principal's
daily total (what ``policy``'s ``daily_tokens`` budget reads) in the terminal move's pipeline."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from broker import keys
from workers import metrics
from workers.hooks.hook import Hook, Writer

if TYPE_CHECKING:
    from workers.runner import Running

DAY_TTL = 2 * 86400


class Usage(Hook):
    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        principal = run.env.context.get("principal") if run.env is not None else None
        tokens = run.usage or {"in": 0, "out": 0}
        metrics.usage(principal, run.info.kind, run.info.name, tokens["in"], tokens["out"])
        if not principal or run.usage is None:
            return None
        key = keys.usage_day(time.strftime("%Y-%m-%d", time.gmtime()), str(principal))
        total = tokens["in"] + tokens["out"]

        def write(pipe: Any) -> None:
            pipe.incrby(key, total)
            pipe.expire(key, DAY_TTL)

        return write
