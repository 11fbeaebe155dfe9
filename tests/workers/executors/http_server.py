"""A real HTTP server on 127.0.0.1 for executor tests, recording every request it gets."""

from __future__ import annotations

import json
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit


class Recorder(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests: list[dict] = []
        self.received: list[float] = []  # when each request came in (time.time())
        self.replies: list[tuple[int, dict]] = []  # (status, headers) answering the next requests, in turn
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def get_request(self):  # counts every TCP connection, even ones that never send a request
        self.connections += 1
        return super().get_request()

    def close(self) -> None:
        self.stop.set()
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: Recorder

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _send(
        self, status: int, body: bytes, ctype: str = "application/json", extra: dict | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode("utf-8", "replace") if length else ""
        parts = urlsplit(self.path)
        record = {
            "method": self.command,
            "raw_path": parts.path,
            "raw_query": parts.query,
            "query": parse_qsl(parts.query, keep_blank_values=True),
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body,
        }
        self.server.requests.append(record)
        self.server.received.append(time.time())
        if self.server.replies:
            status, headers = self.server.replies.pop(0)
            self._send(status, b"{}", extra=headers)
            return
        path = parts.path
        query = dict(parse_qsl(parts.query))
        if path.startswith("/status/"):
            code = int(path.rsplit("/", 1)[1])
            self.server.stop.wait(float(query.get("after", 0)))  # (seconds before it answers)
            self._send(code, b"backend says no: " + query.get("msg", "").encode(), "text/plain")
        elif path == "/redirect":
            self._send(int(query.get("code", 302)), b"", "text/plain", {"Location": query["to"]})
        elif path == "/big":
            self._send(200, b"x" * (2 * 1024 * 1024), "text/plain")
        elif path == "/gzip":  # ?size= bytes of "0", gzipped (200 MiB: a 200 KB bomb)
            packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
            size, block = int(query["size"]), b"0" * (1 << 20)
            body = b"".join(packer.compress(block[: min(len(block), size - i)]) for i in range(0, size, len(block)))
            self._send(200, body + packer.flush(), "text/plain", {"Content-Encoding": "gzip"})
        elif path == "/text":
            self._send(200, "plain 北京\n".encode(), "text/plain; charset=utf-8")
        elif path == "/slow":
            self.server.stop.wait(30)
            self._send(200, b"{}")
        elif path == "/dribble":  # header lines a little at a time, for ever (until the test ends)
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for i in range(300):
                if self.server.stop.wait(0.1):
                    return
                try:
                    self.wfile.write(f"X-Line-{i}: b\r\n".encode())
                    self.wfile.flush()
                except OSError:
                    return
        elif path == "/drip":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):
                if self.server.stop.wait(0.1):
                    return
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
        else:
            self._send(200, json.dumps(record, ensure_ascii=False).encode())

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle
