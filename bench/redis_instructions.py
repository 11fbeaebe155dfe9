"""Instructions Redis executes per call, counted by callgrind: a figure a busy machine does not move.

Redis CPU per call from ``INFO cpu`` (bench/throughput.py) swings by 2x on a shared two-core machine; the
instructions Redis executes for the same work do not. This starts a private ``redis-server`` under
``valgrind --tool=callgrind`` on a unix socket, then drives one call's Redis work directly through
``broker.calls.Calls`` (no worker process): SUBMIT for ``--calls`` calls (pipelined, 100 a round trip),
then CLAIM (8 at a time) and each call's ending TRANSITION (three earlier moves joined to ``done``, as a
busy worker writes them), with no tool limit and with a limit of 8 (the waiting / promote path). The
counters are zeroed before and dumped after each phase (``callgrind_control``).

Caveat: valgrind replaces ``memcpy``, so bytes copied weigh more here than on the CPU; compare trees
with it, not with ``INFO cpu``'s µs. Written to ``bench/results/redis-instructions-<date>-<commit>.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, ROOT  # noqa: E402

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Counted:
    """A redis-server under callgrind on a unix socket in ``work``."""

    def __init__(self, work: Path) -> None:
        self.work, self.sock = work, work / "redis.sock"
        self.proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={work}/callgrind.out.%p",
             "redis-server", "--port", "0", "--unixsocket", str(self.sock), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        import redis

        deadline = time.monotonic() + 60
        while True:
            try:
                redis.Redis(unix_socket_path=str(self.sock)).ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server under valgrind did not start") from None
                time.sleep(0.2)

    def zero(self) -> None:
        subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], capture_output=True, check=True)

    def dump(self) -> int:
        """Instructions since the last zero."""
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], capture_output=True, check=True)
        newest = max(glob.glob(f"{self.work}/callgrind.out.{self.proc.pid}.*"), key=os.path.getmtime)
        for line in Path(newest).read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError(f"no totals in {newest}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def measure(server: Counted, n: int, limit: int) -> dict[str, float]:
    """Thousands of instructions per call: SUBMIT, then CLAIM + the ending TRANSITION."""
    from broker import keys
    from broker.calls import CallInfo, Calls
    from broker.connection import from_url
    from broker.envelope import Envelope
    from broker.states import State

    conn = from_url(f"unix://{server.sock}")
    calls = Calls(conn)
    calls.load_scripts()
    conn.flushdb()
    queue = f"ri-{uuid.uuid4().hex[:6]}"
    envs = [
        Envelope(call_id=f"{keys.tag(queue)[1:-1]}.{uuid.uuid4().hex}", kind="tool", tool="noop", args={},
                 queue=queue, traceparent=TP, channel="hermes:ch:bench")
        for _ in range(n)
    ]  # fmt: skip
    infos = {e.call_id: CallInfo.of(e, "tool:noop") for e in envs}
    server.zero()
    for i in range(0, n, 100):
        pipe = conn.pipeline(transaction=False)
        for e in envs[i : i + 100]:
            calls.submit(e, ckey="tool:noop", queue_size=1_000_000, max_attempts=3, timeout=30,
                         concurrency=limit, pipeline=pipe)  # fmt: skip
        pipe.execute()
    submit = server.dump()
    server.zero()
    done = 0
    while done < n:
        got = calls.claim([queue], 8, "w", 30)
        if not got:
            raise RuntimeError("nothing to claim")
        pipe = conn.pipeline(transaction=False)
        for c in got:
            now = time.time()
            moves = [(State.ROUTING, None, now), (State.EXECUTING, None, now), (State.FORMATTING, None, now)]
            calls.move(infos[c.call_id], State.DONE, attempt=1, current=State.PENDING, via=moves,
                       detail={"result": {}}, ttl=600, pipeline=pipe)  # fmt: skip
        pipe.execute()
        done += len(got)
    end = server.dump()
    conn.close()
    return {"submit_k": submit / n / 1000, "claim_end_k": end / n / 1000, "total_k": (submit + end) / n / 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        raise SystemExit("valgrind (callgrind) is not installed")
    work = Path(tempfile.mkdtemp(prefix="hermes-callgrind-"))
    server = Counted(work)
    try:
        rows = {"no_limit": measure(server, args.calls, -1), "limit_8": measure(server, args.calls, 8)}
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for name, r in rows.items():
        print(f"{name:<9} thousands of Redis instructions per call: SUBMIT {r['submit_k']:.1f}, "
              f"CLAIM + ending TRANSITION {r['claim_end_k']:.1f}, total {r['total_k']:.1f}")
    result: dict[str, Any] = {"bench": "redis_instructions", "commit": sha, "calls": args.calls,
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}  # fmt: skip
    out = Path(args.out) if args.out else RESULTS / f"redis-instructions-{time.strftime('%Y%m%d-%H%M%S')}-{sha[:7]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
