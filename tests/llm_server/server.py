"""The HTTP side of the test server: routes, SSE streaming, recording, and the ``LLMServer`` handle."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .replies import Answer, Reply, Rule, default_rule


@dataclass
class Recorded:
    """One request as the server received it (header names lower-cased)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    received: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "path": self.path, "headers": self.headers, "body": self.body}


# --- the server -----------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so clients reuse pooled connections as in production
    disable_nagle_algorithm = True  # headers and body go out as separate writes
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet tests

    def _read_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode("utf-8", "replace")

    def _send_json(self, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(data, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        owner = self.server.owner
        path = self.path.split("?")[0].rstrip("/")
        if not path.startswith("/_"):  # the control routes are not traffic under test
            owner._record(self, None)
        if path in ("/v1/models", "/models"):
            model = {"id": owner.model, "object": "model", "created": 0, "owned_by": "hermes-test"}
            self._send_json(200, {"object": "list", "data": [model]})
        elif path == "/_requests":
            self._send_json(200, [r.to_dict() for r in owner.requests])
        elif path == "/health":
            self._send_json(200, {"ok": True})
        else:
            self._send_json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})

    def do_POST(self) -> None:
        owner = self.server.owner
        body = self._read_body()
        path = self.path.split("?")[0].rstrip("/")
        if path == "/_script":
            owner.script(*(body if isinstance(body, list) else [body]))
            self._send_json(200, {"queued": len(owner._queue)})
            return
        if path == "/_reset":
            owner.reset()
            self._send_json(200, {"ok": True})
            return
        owner._record(self, body)
        if path not in ("/v1/chat/completions", "/chat/completions"):
            self._send_json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})
        elif owner.api_key and self.headers.get("Authorization") != f"Bearer {owner.api_key}":
            error = {"message": "Incorrect API key provided", "type": "invalid_request_error"}
            self._send_json(401, {"error": {**error, "code": "invalid_api_key"}})
        elif not isinstance(body, dict):
            self._send_json(
                400, {"error": {"message": "body must be a JSON object", "type": "invalid_request"}}
            )
        else:
            self._chat(body, owner.next_reply(body))

    def _chat(self, body: dict[str, Any], reply: Reply) -> None:
        owner = self.server.owner
        if reply.delay and owner.stopping.wait(reply.delay):
            return
        if reply.drop:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if reply.status >= 400:
            message = reply.error or f"simulated HTTP {reply.status}"
            kind = "server_error" if reply.status >= 500 else "invalid_request_error"
            self._send_json(reply.status, {"error": {"message": message, "type": kind}}, reply.headers)
        elif reply.body is not None:
            self._send_json(200, reply.body, reply.headers)
        elif not body.get("stream"):
            self._send_json(200, Answer(reply, body, owner.model).completion(), reply.headers)
        else:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = (
                reply.events
                if reply.events is not None
                else Answer(reply, body, owner.model).chunks(include_usage)
            )
            self._stream(reply, chunks)

    def _stream(self, reply: Reply, chunks: list[Any]) -> None:
        owner = self.server.owner
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in reply.headers.items():
            self.send_header(k, v)
        self.end_headers()
        data = [c if isinstance(c, str) else json.dumps(c, ensure_ascii=False) for c in chunks]
        events = [f"data: {d}\n\n".encode() for d in data]
        if reply.done:
            events.append(b"data: [DONE]\n\n")
        try:
            for i, event in enumerate(events):
                if reply.on_chunk is not None:
                    reply.on_chunk(i)
                if i and reply.chunk_delay and owner.stopping.wait(reply.chunk_delay):
                    return
                self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            with owner._lock:
                owner.client_gone += 1


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: LLMServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that hang up mid-answer are part of the tests, not noise for stderr


class LLMServer:
    """The test server: scripted replies first, then ``rule`` (if it answers), then ``default_rule``."""

    def __init__(
        self,
        rule: Rule | None = None,
        *,
        model: str = "hermes-test",
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.rule = rule
        self.model = model
        self.api_key = api_key
        self.requests: list[Recorded] = []
        self.client_gone = 0  # streams the client abandoned before the end
        self.stopping = threading.Event()
        self._queue: deque[Reply] = deque()
        self._lock = threading.Lock()
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.owner = self
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What to put in ``model.base_url``."""
        return f"{self.url}/v1"

    @property
    def chat_requests(self) -> list[Recorded]:
        """Only the chat-completions requests."""
        return [r for r in self.requests if r.path.rstrip("/").endswith("/chat/completions")]

    def script(self, *replies: Reply | dict[str, Any]) -> None:
        """Queue replies for the next chat requests, in order."""
        with self._lock:
            for r in replies:
                self._queue.append(r if isinstance(r, Reply) else Reply.from_dict(r))

    def reset(self) -> None:
        """Forget recorded requests and queued replies."""
        with self._lock:
            self._queue.clear()
            self.requests.clear()

    def next_reply(self, body: dict[str, Any]) -> Reply:
        """The reply for this request: script, then rule, then the default rule."""
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        answer = self.rule(body) if self.rule is not None else None
        if answer is None:
            return default_rule(body)
        return answer if isinstance(answer, Reply) else Reply.from_dict(answer)

    def _record(self, handler: _Handler, body: Any) -> None:
        headers = {k.lower(): v for k, v in handler.headers.items()}
        with self._lock:
            self.requests.append(Recorded(handler.command, handler.path, headers, body))

    def start(self) -> LLMServer:
        """Serve on a background thread."""
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="llm-server"
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until interrupted (the standalone process)."""
        try:
            self._httpd.serve_forever()
        finally:
            self.stopping.set()
            self._httpd.server_close()

    def stop(self) -> None:
        """Stop serving and wake every handler that is waiting on a delay."""
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> LLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


try:
    import pytest
except ImportError:  # the standalone server does not need pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def llm_server() -> Any:
        """A started LLMServer, stopped after the test (``pytest_plugins = ["tests.llm_server"]``)."""
        with LLMServer() as server:
            yield server
