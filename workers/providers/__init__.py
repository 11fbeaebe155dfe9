"""LLM providers: the protocol the ``llm`` worker calls, and the OpenAI-compatible implementation."""

from __future__ import annotations

from .backoff import give_up_reason, parse_retry_after, retry_delay
from .provider import Provider, ProviderContext, close_all, create, get_provider

__all__ = [
    "Provider", "ProviderContext", "close_all", "create", "get_provider", "give_up_reason",
    "parse_retry_after", "retry_delay",
]
