"""The provider protocol, the context a provider call runs in, and the per-process provider cache."""

from __future__ import annotations

import hashlib
import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker.errors import ConfigError, HermesError, ProviderTimeout
from broker.settings import ModelSettings
from workers.executors import Deadline, PerProcess

DeltaSink = Callable[[dict[str, Any]], None]

# `model.provider` spellings -> module under workers.providers; the servers named here all speak the
# OpenAI chat-completions dialect.
_MODULES: dict[str, str] = dict.fromkeys(
    ("openai-compatible", "openai_compatible", "openai_compat", "openai", "custom", "deepseek", "ollama")
    + ("vllm", "lmstudio", "llamacpp", "llama.cpp"),
    "openai_compat",
)

# Where a named server listens by default, used when ``model.base_url`` is not given.
DEFAULT_BASE_URLS: dict[str, str] = {
    "deepseek": "https://api.deepseek.com/v1",
    "ollama": "http://127.0.0.1:11434/v1",
    "vllm": "http://127.0.0.1:8000/v1",
    "lmstudio": "http://127.0.0.1:1234/v1",
    "llamacpp": "http://127.0.0.1:8080/v1",
    "llama.cpp": "http://127.0.0.1:8080/v1",
}


def base_url_of(settings_model: ModelSettings) -> str:
    """``model.base_url``, else the named provider's default address ('' when neither)."""
    return settings_model.base_url or DEFAULT_BASE_URLS.get(settings_model.provider.strip().lower(), "")


@dataclass
class ProviderContext(Deadline):
    """What a provider call gets besides the request: deadline, cancellation, stream sink, trace."""

    call_id: str
    timeout: float = 120.0
    attempt: int = 1
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_delta: DeltaSink | None = None
    # Called when the response headers arrive: the rate limiter counts the request's window from then.
    on_response: Callable[[], None] | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    started: float = field(default_factory=time.monotonic)
    status_code: int | None = None  # the provider's HTTP status, once its response came

    def timed_out(self) -> HermesError:
        return ProviderTimeout(f"LLM call {self.call_id} timed out after {self.timeout:g}s")


class Provider(Protocol):
    """Runs one chat-completions request and returns the provider's own response shape."""

    def complete(self, request: dict[str, Any], ctx: ProviderContext) -> dict[str, Any]: ...

    def close(self) -> None: ...


_instances: PerProcess[tuple[str, str, str], Provider] = PerProcess()


def provider_module(name: str) -> str:
    """The module name under ``workers.providers`` that serves ``model.provider``."""
    key = (name or "openai-compatible").strip().lower()
    if (module := _MODULES.get(key)) is None:
        raise ConfigError(f"unknown model provider {name!r}; known: {', '.join(sorted(_MODULES))}")
    return module


def _cache_key(settings_model: ModelSettings) -> tuple[str, str, str]:
    api_key = settings_model.api_key  # hashed: the cache never holds (or prints) the secret itself
    digest = hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else ""
    return (provider_module(settings_model.provider), base_url_of(settings_model), digest)


def create(settings_model: ModelSettings) -> Provider:
    """A new provider from the ``model:`` settings (not cached)."""
    module = importlib.import_module(f"{__package__}.{provider_module(settings_model.provider)}")
    return module.create(settings_model)


def get_provider(settings_model: ModelSettings) -> Provider:
    """One provider per (provider, base_url, api_key) per process, created on first use."""
    return _instances.get(_cache_key(settings_model), lambda: create(settings_model))


def close_all() -> None:
    """Close every cached provider (worker shutdown)."""
    _instances.close_all()
