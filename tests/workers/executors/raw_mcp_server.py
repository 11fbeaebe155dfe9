"""A hand-spoken MCP server that misbehaves on purpose: ``garbage`` writes a line that is not UTF-8 before
its answer; ``flood`` starts its answer and never ends it; ``bomb`` answers 200 MiB of text; any other tool
answers with its arguments. ``python raw_mcp_server.py`` speaks stdio; ``serve_http()`` streamable HTTP (JSON
bodies, or SSE ones; gzipped: the bomb is 200 KB sent)."""

from __future__ import annotations

import json
import sys
import threading
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
        if name == "bomb":
            write(FLOOD_START % mid)
            for _ in range(200):
                write(b"x" * (1 << 20))
            write(b'"}]}}')
            return None
        if name == "garbage":
            write(b"\xff\xfe not json \xc3\x28\n")
        text = "after garbage" if name == "garbage" else json.dumps(args)
        return {"jsonrpc": "2.0", "id": mid, "result": {"content": [{"type": "text", "text": text}]}}
    if mid is not None:
        return {"jsonrpc": "2.0", "id": mid, "result": {"tools": []} if method == "tools/list" else {}}
    return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # no server-to-client stream
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if msg.get("id") is None:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        sse, packer = getattr(self.server, "sse", False), getattr(self.server, "packer", None)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream" if sse else "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        if packer is not None:
            self.send_header("Content-Encoding", "gzip")
            packer = packer()
        self.end_headers()

        def send(data: bytes) -> None:
            if data:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        def chunk(data: bytes) -> None:
            send(packer.compress(data) if packer is not None else data)

        if sse:
            chunk(b"event: message\ndata: ")
        reply = answer(msg, chunk)
        chunk((json.dumps(reply).encode() if reply is not None else b"") + (b"\n\n" if sse else b""))
        if packer is not None:
            send(packer.flush())
        self.wfile.write(b"0\r\n\r\n")


def serve_http(sse: bool = False, gzip: bool = False) -> ThreadingHTTPServer:
    """The server on a free port of 127.0.0.1, serving on a daemon thread (``shutdown()`` stops it)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads, server.sse = True, sse  # type: ignore[attr-defined]
    if gzip:
        server.packer = lambda: zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


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
