"""``python -m workers``: one worker process (what the pool supervisor starts)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from broker.config import load_settings
from broker.errors import HermesError
from broker.logs import configure
from workers.pool import run_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers")
    parser.add_argument("--queues", default="tools,llm")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--grace", type=float, default=25.0)
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics on this port")
    parser.add_argument("--metrics-host", default=None)
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        if args.metrics_port is not None:  # (what the pool passes its children in the environment)
            host = args.metrics_host or settings.workers.metrics_host
            metrics = dataclasses.replace(settings.workers, metrics_port=args.metrics_port, metrics_host=host)
            settings = dataclasses.replace(settings, workers=metrics)
        configure(settings.logging.level, settings.logging.format, batched=True)
        url = settings.broker.url
        if not url:
            print("error: HERMES_REDIS_URL is not set; a worker process needs a broker URL", file=sys.stderr)
            return 2
        queues = [q for q in args.queues.split(",") if q]
        return run_worker(url, settings, queues, args.concurrency, args.grace)
    except HermesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
