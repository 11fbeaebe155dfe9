"""What one warm no-op tool call crosses on the worker side: our modules and the threads they run on.

A worker runs in this process on a Redis (``--url``, else a private one); after a warm-up call, a profiler
records each function of ours entered on the worker's threads from the call's submission to its end.
Background threads that do not serve the call (heartbeat, control channel, retry scheduler) are listed
apart. ``python bench/call_walk.py`` prints the modules per thread and the totals.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, scratch_home, using_broker  # noqa: E402

PACKAGES = tuple(str(ROOT / p) + "/" for p in ("broker", "workers", "middleware", "hermes_gateway"))
BACKGROUND = ("hermes-heartbeat", "hermes-control", "hermes-retry", "hermes-stats")
TOOL = {"name": "noop", "executor": "python", "function": "workers.executors.builtin:echo", "timeout": 5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=None)
    parser.add_argument("--functions", action="store_true", help="also list the functions")
    args = parser.parse_args()
    seen: dict[str, set[str]] = defaultdict(set)
    functions: set[tuple[str, str]] = set()
    recording = threading.Event()

    def profile(frame, event, _arg):  # type: ignore[no-untyped-def]
        if event == "call" and recording.is_set():
            path = frame.f_code.co_filename
            if path.startswith(PACKAGES):
                module = path[len(str(ROOT)) + 1:]
                seen[threading.current_thread().name].add(module)
                functions.add((module, frame.f_code.co_qualname))

    with using_broker(args.url) as url:
        import os

        os.environ["HERMES_HOME"] = str(scratch_home([TOOL]))
        from broker.calls import Calls
        from broker.config import load_settings
        from broker.connection import from_url
        from broker.directory import Directory
        from broker.envelope import Envelope, Options
        from workers.specs import check_spec
        from workers.worker import Worker

        conn = from_url(url)
        settings = load_settings()
        Directory(conn).register(check_spec(TOOL))
        threading.setprofile(profile)
        worker = Worker(conn, settings, ["tools"], concurrency=8)
        thread = threading.Thread(target=worker.work, name="hermes-dispatch", daemon=True)
        thread.start()
        calls = Calls(conn)

        def call(call_id: str) -> None:
            env = Envelope(call_id=call_id, kind="tool", tool="noop", args={"x": 1}, channel="hermes:ch:walk", traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                           options=Options(max_attempts=1))
            calls.submit(env, ckey="tool:noop", queue_size=-1, max_attempts=1, timeout=5)
            deadline = time.monotonic() + 10
            while (calls.record(call_id) or {}).get("state") != "done":
                if time.monotonic() > deadline:
                    raise SystemExit(f"{call_id} did not end")
                time.sleep(0.01)

        tag = "{tools}."  # (fresh ids: a Redis kept from an earlier run still holds that run's ended calls)
        call(tag + uuid.uuid4().hex)  # warm-up: imports, scripts, the directory cache
        time.sleep(0.5)
        recording.set()
        call(tag + uuid.uuid4().hex)
        time.sleep(0.2)  # (the outbox's last reply)
        recording.clear()
        worker.request_stop()
        thread.join(30)
    serving = {t: m for t, m in seen.items() if not t.startswith(BACKGROUND)}
    kinds = defaultdict(set)
    for name, modules in serving.items():
        kinds[name.split("_")[0]].update(modules)
    for name, modules in sorted(kinds.items()):
        print(f"{name}: {len(modules)} modules: {', '.join(sorted(modules))}")
    background = {t for t in seen if t.startswith(BACKGROUND)}
    if background:
        print(f"(background, not counted: {', '.join(sorted(background))})")
    modules = set().union(*kinds.values()) if kinds else set()
    ours = {f for f in functions if f[0] in modules}
    if "--functions" in sys.argv[1:]:
        print(sorted(ours))
    print(f"worker side: {len(modules)} modules, {len(ours)} functions, {len(kinds)} threads ({', '.join(sorted(kinds))})")


if __name__ == "__main__":
    main()
