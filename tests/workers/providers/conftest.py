"""A real local OpenAI-compatible server and a provider pointed at it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.llm_server import LLMServer
from workers.providers.openai_compat import OpenAICompatProvider

from .support import API_KEY


@pytest.fixture
def server() -> Iterator[LLMServer]:
    with LLMServer(api_key=API_KEY) as srv:
        yield srv


@pytest.fixture
def provider(server: LLMServer) -> Iterator[OpenAICompatProvider]:
    prov = OpenAICompatProvider(base_url=server.base_url, api_key=API_KEY, model="test-model", timeout=10)
    yield prov
    prov.close()
