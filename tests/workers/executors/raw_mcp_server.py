"""A hand-spoken stdio MCP server that misbehaves on purpose: ``garbage`` writes a line that is not UTF-8
before its answer; any other tool answers with its arguments."""

import json
import sys

out = sys.stdout.buffer


def send(message: dict) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


for line in sys.stdin.buffer:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    method, mid = msg.get("method"), msg.get("id")
    if method == "initialize":
        info = {"name": "raw", "version": "1"}
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}}, "serverInfo": info}})
    elif method == "tools/call":
        name, args = msg["params"]["name"], msg["params"].get("arguments") or {}
        if name == "garbage":
            out.write(b"\xff\xfe not json \xc3\x28\n")
        text = "after garbage" if name == "garbage" else json.dumps(args)
        send({"jsonrpc": "2.0", "id": mid, "result": {"content": [{"type": "text", "text": text}]}})
    elif mid is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": []} if method == "tools/list" else {}})
