"""A hand-spoken MCP server that misbehaves on purpose: ``garbage`` writes a line that is not UTF-8 before
its answer; ``flood`` starts its answer and never ends it; any other tool answers with its arguments.
Spoken on stdio."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

FLOOD_START = b'{"jsonrpc": "2.0", "id": %d, "result": {"content": [{"type": "text", "text": "'


def answer(msg: dict, write: Callable[[bytes], object]) -> dict | None:
    """The reply to one message (None: none); ``flood`` writes through ``write`` until it fails."""
    method, mid = msg.get("method"), msg.get("id")
    if method == "initialize":
        info = {"name": "raw", "version": "1"}
        return {"jsonrpc": "2.0", "id": mid, "result": {
            "protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}}, "serverInfo": info}}
    if method == "tools/call":
        name, args = msg["params"]["name"], msg["params"].get("arguments") or {}
        if name == "flood":
            write(FLOOD_START % mid)
            while True:
                write(b"x" * 65536)
        if name == "garbage":
            write(b"\xff\xfe not json \xc3\x28\n")
        text = "after garbage" if name == "garbage" else json.dumps(args)
        return {"jsonrpc": "2.0", "id": mid, "result": {"content": [{"type": "text", "text": text}]}}
    if mid is not None:
        return {"jsonrpc": "2.0", "id": mid, "result": {"tools": []} if method == "tools/list" else {}}
    return None


if __name__ == "__main__":
    out = sys.stdout.buffer

    def write(data: bytes) -> None:
        out.write(data)
        out.flush()

    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if (reply := answer(message, write)) is not None:
            write(json.dumps(reply).encode() + b"\n")
