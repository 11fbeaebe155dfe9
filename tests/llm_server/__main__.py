"""``python -m tests.llm_server --port N --script FILE``: the test server as a standalone process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import __doc__ as package_doc
from .server import LLMServer


def _load_script(path: str) -> list[dict[str, Any]]:
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("replies", [data])
    return list(data or [])


def main(argv: list[str] | None = None) -> None:
    """Run the server in the foreground until interrupted."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.llm_server", description=(package_doc or "").strip().splitlines()[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--script", help="JSON or YAML list of replies to serve first")
    parser.add_argument("--model", default="hermes-test")
    parser.add_argument("--api-key", default=None, help="require this bearer token")
    args = parser.parse_args(argv)
    server = LLMServer(model=args.model, api_key=args.api_key, host=args.host, port=args.port)
    if args.script:
        server.script(*_load_script(args.script))
    print(f"LLM server listening on http://{args.host}:{server.port}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
