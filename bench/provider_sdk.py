"""Our OpenAI-compatible provider against the official ``openai`` SDK, on one local test server.

Both stream the same replies (``--chunks`` SSE chunks of 8 characters) and fetch the same non-streamed
ones from ``tests/llm_server`` in this process; the figure is CPU per call (process time: both clients
and the server thread, the server's share being the same for both), interleaved ``--rounds`` times.
The SDK parses every chunk into a pydantic model; ours hands the JSON on as it is. Last line:
``sdk_cpu_ratio=<SDK CPU / ours, streamed>``.

    python bench/provider_sdk.py [-n 40] [--chunks 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.llm_server.replies import Reply  # noqa: E402
from tests.llm_server.server import LLMServer  # noqa: E402
from workers.providers.openai_compat import OpenAICompatProvider  # noqa: E402
from workers.providers.provider import ProviderContext  # noqa: E402


def cpu_per_call(fn: Callable[[], None], n: int) -> float:
    for _ in range(3):
        fn()
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=40, help="calls per measurement")
    ap.add_argument("--chunks", type=int, default=200, help="stream chunks per reply")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import openai

    messages = [{"role": "user", "content": "hi"}]
    with LLMServer() as srv:
        srv.script(*[Reply(text="x" * 8 * args.chunks) for _ in range(10 * args.n * args.rounds + 100)])
        ours = OpenAICompatProvider(base_url=srv.base_url, api_key="k", model="m")
        sdk = openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0)

        def ours_stream() -> None:
            ours.complete(
                {"messages": messages, "stream": True}, ProviderContext("c", on_delta=lambda d: None)
            )

        def sdk_stream() -> None:
            for chunk in sdk.chat.completions.create(model="m", messages=messages, stream=True):  # type: ignore[arg-type]
                chunk.to_dict()  # type: ignore[union-attr]

        def ours_whole() -> None:
            ours.complete({"messages": messages}, ProviderContext("c"))

        def sdk_whole() -> None:
            sdk.chat.completions.create(model="m", messages=messages).to_dict()  # type: ignore[arg-type]

        figures: dict[str, list[float]] = {
            k: [] for k in ("ours_stream", "sdk_stream", "ours_whole", "sdk_whole")
        }
        for r in range(args.rounds):
            for name, fn in (
                ("ours_stream", ours_stream),
                ("sdk_stream", sdk_stream),
                ("ours_whole", ours_whole),
                ("sdk_whole", sdk_whole),
            ):
                figures[name].append(cpu_per_call(fn, args.n))
            print(f"round {r + 1}: " + " ".join(f"{k}={v[-1]:.2f}ms" for k, v in figures.items()), flush=True)
        ours.close()
        sdk.close()
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(
        f"CPU per call (median ms): streamed {args.chunks} chunks ours {med['ours_stream']:.2f}, "
        f"SDK {med['sdk_stream']:.2f}; not streamed ours {med['ours_whole']:.2f}, SDK {med['sdk_whole']:.2f}"
    )
    print(f"sdk_whole_cpu_ratio={med['sdk_whole'] / med['ours_whole']:.2f}")
    print(f"sdk_cpu_ratio={med['sdk_stream'] / med['ours_stream']:.2f}")


if __name__ == "__main__":
    main()
