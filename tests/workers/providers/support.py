"""Shared bits of the provider tests."""

from __future__ import annotations

from typing import Any

from workers.providers.provider import ProviderContext

API_KEY = "sk-test-7f3a9c1e5b"


def make_ctx(**kw: Any) -> ProviderContext:
    """A context with a short timeout so a hang fails the test instead of stalling the suite."""
    kw.setdefault("call_id", "call-1")
    kw.setdefault("timeout", 10.0)
    return ProviderContext(**kw)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]
