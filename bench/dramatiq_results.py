"""The Dramatiq side of ``bench/mix.py``: a sleeping actor whose result the caller waits for, as a Dramatiq
user waits for one (the ``Results`` middleware on a Redis backend, ``message.get_result(block=True)``).

Two actors on the same function: ``batch_sleep`` on the batch's queue at a low priority, and
``first_sleep`` on a queue of its own at the highest: a Dramatiq worker fetches each queue with a consumer of
its own and runs the fetched messages in priority order, which is how a Dramatiq user puts an agent's call
ahead of a batch. Queue names and the broker URL come from the environment (``BENCH_DRAMATIQ_QUEUE``,
``BENCH_DRAMATIQ_FIRST``, ``BENCH_DRAMATIQ_URL``) so the worker and the sending benchmark agree on them.
"""

from __future__ import annotations

import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.results import Results
from dramatiq.results.backends.redis import RedisBackend

URL = os.environ.get("BENCH_DRAMATIQ_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("BENCH_DRAMATIQ_QUEUE", "bench")
FIRST = os.environ.get("BENCH_DRAMATIQ_FIRST", "bench-first")
RESULT_TTL_MS = 600_000  # results kept 10 min: past any benchmark's measurement (bench/memory.py counts them)

broker = RedisBroker(url=URL)
# (no socket timeout: redis-py 8's default of 5 s would cut a blocking wait for a result that takes longer)
backend = RedisBackend(client=redis.Redis.from_url(URL, socket_timeout=None))
broker.add_middleware(Results(backend=backend, result_ttl=RESULT_TTL_MS))
dramatiq.set_broker(broker)


# (Dramatiq: lower numbers run first among the messages a worker has fetched)
@dramatiq.actor(actor_name="batch_sleep", queue_name=QUEUE, max_retries=0, store_results=True, priority=100)
def batch_sleep(seconds: float) -> float:
    """A batch's job: wait ``seconds``, like ``workers.executors.builtin:sleep``."""
    time.sleep(seconds)
    return seconds


@dramatiq.actor(actor_name="first_sleep", queue_name=FIRST, max_retries=0, store_results=True, priority=0)
def first_sleep(seconds: float) -> float:
    """An agent's job, the same work on the preferred queue."""
    time.sleep(seconds)
    return seconds


@dramatiq.actor(actor_name="noop_text", queue_name=QUEUE, max_retries=0, store_results=True)
def noop_text(text: str) -> None:
    """Nothing, with arguments (``bench/memory.py``'s 100 bytes); its result (None) is stored."""
