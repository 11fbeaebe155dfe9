"""LLM providers: the protocol the ``llm`` worker calls, and the OpenAI-compatible implementation."""

from __future__ import annotations

from .base import Provider, ProviderContext, close_all, create, get_provider
from .retry import give_up_reason, parse_retry_after, retry_delay

__all__ = [
    "Provider",
    "ProviderContext",
    "close_all",
    "create",
    "get_provider",
    "give_up_reason",
    "parse_retry_after",
    "retry_delay",
]
