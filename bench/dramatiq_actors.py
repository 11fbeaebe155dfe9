"""The Dramatiq side of ``bench/throughput.py``: one no-op actor on a Redis broker.

Its queue and broker URL come from the environment (``BENCH_DRAMATIQ_QUEUE``, ``BENCH_DRAMATIQ_URL``), so
the worker (``dramatiq bench.dramatiq_actors``) and the sending benchmark agree on them. No result backend:
Dramatiq stores no result; a message is done when its worker acks it (it leaves ``<queue>.msgs``).
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

QUEUE = os.environ.get("BENCH_DRAMATIQ_QUEUE", "bench")
broker = RedisBroker(url=os.environ.get("BENCH_DRAMATIQ_URL", "redis://127.0.0.1:6379/0"))
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def noop() -> None:
    """Nothing, like ``workers.executors.builtin:noop``."""
