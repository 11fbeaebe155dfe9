"""The provider cache and the context."""

from __future__ import annotations

import pytest

from broker.errors import CallCancelled, ConfigError, ProviderTimeout
from broker.settings import ModelSettings
from workers.providers import provider as base
from workers.providers.openai_compat import OpenAICompatProvider


@pytest.fixture(autouse=True)
def _fresh_cache():
    base.close_all()
    yield
    base.close_all()


def _model(**kw):
    return ModelSettings(**{"provider": "openai-compatible", "base_url": "http://127.0.0.1:9/v1", "api_key": "k1", **kw})


def test_get_provider_is_cached_per_provider_base_url_and_key():
    first = base.get_provider(_model())
    assert base.get_provider(_model(model="other", timeout=5)) is first
    assert base.get_provider(_model(provider="openai")) is first  # same module, same endpoint
    assert base.get_provider(_model(api_key="k2")) is not first
    assert base.get_provider(_model(base_url="http://127.0.0.1:10/v1")) is not first
    assert isinstance(first, OpenAICompatProvider)


def test_cache_does_not_hold_the_key_in_clear():
    base.get_provider(_model(api_key="sk-very-secret"))
    assert "sk-very-secret" not in repr(list(base._instances.items))


def test_create_reads_the_model_block():
    prov = base.create(_model(model="deepseek-chat", timeout=7, max_retries=4))
    assert isinstance(prov, OpenAICompatProvider)
    assert (prov.model, prov.timeout, prov.max_retries) == ("deepseek-chat", 7.0, 4)
    assert "k1" not in repr(prov)
    prov.close()


def test_unknown_provider_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown model provider"):
        base.get_provider(_model(provider="carrier-pigeon"))


def test_context_check_raises_cancelled_then_timeout():
    ctx = base.ProviderContext(call_id="c", timeout=60)
    ctx.check()
    ctx.cancelled.set()
    with pytest.raises(CallCancelled):
        ctx.check()
    late = base.ProviderContext(call_id="c", timeout=1, started=0.0)
    with pytest.raises(ProviderTimeout):
        late.check()


def test_local_servers_by_name_get_their_default_address_and_a_given_one_wins():
    ollama = base.create(ModelSettings(provider="ollama", model="qwen2.5"))
    assert isinstance(ollama, OpenAICompatProvider) and ollama.base_url == "http://127.0.0.1:11434/v1"
    assert base.create(ModelSettings(provider="DeepSeek")).base_url == "https://api.deepseek.com/v1"
    assert base.create(ModelSettings(provider="vllm", base_url="http://10.0.0.5:9000/v1/")).base_url == "http://10.0.0.5:9000/v1"
    # the cache key follows the address actually used
    assert base.get_provider(ModelSettings(provider="ollama")) is base.get_provider(ModelSettings(provider="openai", base_url="http://127.0.0.1:11434/v1"))
    with pytest.raises(ConfigError, match="model.base_url is required.*ollama"):
        base.create(ModelSettings(provider="openai-compatible"))
    with pytest.raises(ConfigError, match="unknown model provider 'telepathy'"):
        base.create(ModelSettings(provider="telepathy"))
