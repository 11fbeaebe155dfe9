"""A local OpenAI-compatible chat-completions server for tests, benchmarks and the real hermes-agent.

In-process::

    with LLMServer() as server:                      # 127.0.0.1, free port, background thread
        provider = OpenAICompatProvider(base_url=server.base_url, api_key="sk-test")
        server.script(Reply(status=429, headers={"Retry-After": "2"}), Reply(text="hi"))
        ...
        server.requests[-1].headers["traceparent"]

Standalone: ``python -m tests.llm_server --port 8400 --script replies.json`` (a JSON or YAML list of
replies; each is a dict of ``Reply`` fields). Other processes can script and inspect it over HTTP:
``POST /_script`` (one reply or a list), ``GET /_requests``, ``POST /_reset``.

Without a script the default rule answers like a tiny, predictable model: "Reply exactly X" -> "X";
"weather in X" (or "X的天气") with a ``get_weather`` tool offered -> a tool call ``get_weather({"city": X})``;
after a tool message -> text quoting the tool result; anything else -> "echo: <last user message>".
"""

from __future__ import annotations

from .replies import Reply, Rule, default_rule
from .server import LLMServer, Recorded, llm_server

__all__ = ["LLMServer", "Recorded", "Reply", "Rule", "default_rule", "llm_server"]
