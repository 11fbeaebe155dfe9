"""One LLM call in a worker: provider kwargs, the contract's LLM flow per attempt, retries with Retry-After.

Every provider attempt runs the whole LLM flow again, so hooks see each attempt; stream deltas become
``delta`` events and each retry a ``progress`` event. The ``model:`` settings (api key included) never go
into an event or a log.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import redis
import structlog

from broker.envelope import plugins_applied
from broker.errors import CallCancelled, HermesError, ProviderError, ProviderTimeout
from broker.events import DELTA, PROGRESS
from broker.settings import ModelSettings
from workers.executors import ExecContext
from workers.providers import ProviderContext, get_provider, give_up_reason, retry_delay
from workers.providers.provider import base_url_of
from workers.telemetry import record_usage

if TYPE_CHECKING:
    from workers.providers import Provider
    from workers.runner import CallRunner, Running, WorkerCore

log = structlog.get_logger("hermes.worker")

DEFAULT_PROVIDER = "openai-compatible"
DEFAULT_API_MODE = "chat_completions"

# Runtime context an LLM call takes from its envelope; provider/model/api_mode are settled here.
LLM_CONTEXT = ("session_id", "task_id", "turn_id", "api_request_id")


def provider_kwargs(
    request: Mapping[str, Any], context: Mapping[str, Any], model_settings: ModelSettings
) -> dict[str, Any]:
    """The caller's request with the model filled in: its own, else the context's, else ``model.model``."""
    kwargs = copy.deepcopy(dict(request))
    model = kwargs.get("model") or context.get("model") or model_settings.model
    if model:
        kwargs["model"] = model
    return kwargs


def reported_usage(response: Any) -> dict[str, int] | None:
    """A chat completion's reported tokens as ``{"in": prompt, "out": completion}`` (None without usage)."""
    usage = response.get("usage") if isinstance(response, Mapping) else None
    if not isinstance(usage, Mapping):
        return None
    try:
        tokens_in, tokens_out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    except (TypeError, ValueError):
        return None
    if not tokens_in and not tokens_out:
        total = usage.get("total_tokens")
        tokens_in = int(total) if isinstance(total, int) and not isinstance(total, bool) else 0
    return {"in": max(0, tokens_in), "out": max(0, tokens_out)}


def describe_response(response: Any) -> dict[str, Any]:
    """Fields of a chat completion that ``post_api_request`` observers get besides the response."""
    if not isinstance(response, Mapping):
        return {}
    choices = response.get("choices") or []
    first = choices[0] if choices and isinstance(choices[0], Mapping) else {}
    return {"usage": response.get("usage"), "finish_reason": first.get("finish_reason")}


def _without_userinfo(url: str) -> str:
    """A base URL as hooks may see it: any ``user:password@`` left out."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


# A call refused for its rate goes back to waiting this many times at most, then fails as a retry would.
RATE_RETURNS = 10
PAUSE_STATUSES = (429, 503)
DEFAULT_PAUSE = 1.0  # seconds a 429/503 without a time to wait pauses its key


class RateLimited(Exception):  # noqa: N818 - control flow, not an error (as Dramatiq's Retry)
    """The provider refused a rate-limited key's request: the key is paused until ``until`` (unix s)."""

    def __init__(self, until: float) -> None:
        super().__init__(f"paused until {until:.3f}")
        self.until = until


@dataclass
class _LLMContext(ExecContext):
    """An LLM call's context: running out of time is a ProviderTimeout."""

    def timed_out(self) -> HermesError:
        return ProviderTimeout(f"LLM call {self.call_id} timed out after {self.timeout:g}s")


class Response(dict[str, Any]):
    """A provider response as plain data that also reads as the SDK's object does, for llm_execution
    middleware written against Hermes' adapters: ``r["choices"][0]`` and ``r.choices[0].message.content``
    (a field the response lacks reads as None, as the SDK's optional fields do)."""

    __slots__ = ()
    # (the SDK object's methods: ``hasattr(r, "model_dump")`` must stay False for plain data)
    METHODS = frozenset({"model_dump", "model_dump_json", "model_copy", "to_dict", "to_json", "dict", "json", "copy"})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in Response.METHODS:
            raise AttributeError(name)
        return self.get(name)


def as_response(value: Any) -> Any:
    """``value`` with every mapping in it a :class:`Response`."""
    if isinstance(value, dict):
        return Response({k: as_response(v) for k, v in value.items()})
    if isinstance(value, list):
        return [as_response(v) for v in value]
    return value


class LLMCall:
    """Runs one claimed LLM call up to its response; the runner moves it and publishes its events."""

    def __init__(self, core: WorkerCore, run: Running, runner: CallRunner) -> None:
        self.core = core
        self.run = run
        self.runner = runner
        env = run.env
        cfg = core.settings.model
        self.cfg = cfg
        self.request = run.request = provider_kwargs(env.request or {}, env.context, cfg)
        self.model = str(self.request.get("model") or "")
        self.timeout = float(env.options.timeout or cfg.timeout)
        self.max_retries = cfg.max_retries
        self.max_retry_after = cfg.max_retry_after
        self.context: dict[str, Any] = {
            k: env.context[k] for k in LLM_CONTEXT if env.context.get(k) is not None
        }
        self.context["provider"] = env.context.get("provider") or cfg.provider or DEFAULT_PROVIDER
        self.context["model"] = self.model
        self.context["api_mode"] = env.context.get("api_mode") or cfg.api_mode or DEFAULT_API_MODE
        self.context["platform"] = str(env.context.get("platform") or "")
        self.context["base_url"] = _without_userinfo(base_url_of(cfg))
        run.rate = cfg.rate_limit_for(cfg.provider or DEFAULT_PROVIDER, self.model) is not None  # (the one called)
        # The runner's control channel cancels through run.ctx; the provider watches the same Event.
        self.ctx = _LLMContext(
            call_id=env.call_id,
            tool_name=self.model,
            timeout=self.timeout,
            attempt=run.attempt,
            traceparent=env.traceparent,
            tracestate=env.tracestate,
            settings=core.settings.executor_settings("llm"),
        )
        run.ctx = self.ctx
        if self.core.is_cancelled(env.call_id):
            self.ctx.cancelled.set()

    def execute(self) -> Any:
        """Attempts until one succeeds; raises the error that ends the call (typed, secret-free)."""
        provider = get_provider(self.cfg)
        self.core.check_budget(self.run.env.context.get("principal"))
        n = 1
        while True:
            self.ctx.check()
            try:
                response = self._attempt(provider, n)
            except (ProviderError, ProviderTimeout) as e:
                if isinstance(e, ProviderError) and self.run.rate and e.status in PAUSE_STATUSES:
                    if self.run.attempt <= RATE_RETURNS:
                        self._pause(e)
                delay = self._retry_in(e, n)
                self._announce_retry(e, n, delay)
                if self.ctx.cancelled.wait(delay):
                    raise CallCancelled(f"call {self.run.info.call_id} was cancelled") from None
                info = self.run.info
                # (a retry is one more request the provider counts: the fleet's limiter admits it first; a
                # Redis refusing that entry, at maxmemory or away, ends the call with the provider's error)
                try:
                    while self.run.rate and (wait := self.core.limiter.again(info.call_id, info.queue, info.ckey)):
                        self.ctx.cancelled.wait(min(wait, self.ctx.remaining()))
                        self.ctx.check()
                except redis.RedisError:
                    raise e from None
                n += 1
                continue
            return response

    def _attempt(self, provider: Provider, n: int) -> Any:
        run, ctx = self.run, self.ctx
        context = dict(self.context)
        # Each attempt is its own API request, so hooks can tell attempts apart unless the caller named it.
        context.setdefault("api_request_id", f"{run.info.call_id}-{n}")
        context["api_call_count"] = n

        def call_provider(request: dict[str, Any]) -> Any:
            pctx = ProviderContext(
                call_id=run.info.call_id,
                timeout=self.ctx.remaining(),
                attempt=n,
                cancelled=ctx.cancelled,
                on_delta=self._delta,
                traceparent=ctx.traceparent,
                tracestate=ctx.tracestate,
            )
            run.ran = True
            if run.rate:  # its limiter entry counts from the response (the provider surely has the request)
                run.sent = True
                pctx.on_response = lambda: self.core.rate_sent(run)
            with run.trace.provider(self.model, str(self.context["provider"]), pctx) as span:
                try:
                    response = provider.complete(request, pctx)
                finally:  # (the audit record's status code: this attempt's)
                    self.ctx.status_code = pctx.status_code
                record_usage(span, response)
                run.usage = reported_usage(response)
                # (the done event names the request that answered, its model as llm_request middleware left
                # it: the tool calls it asks for carry them)
                run.api_request = {k: context[k] for k in ("api_request_id", "provider", "api_mode")}
                run.api_request["model"] = str(request.get("model") or self.model)
                return as_response(response)

        response = self.core.llm_flow.run(
            copy.deepcopy(self.request),
            call_provider=call_provider,
            context=context,
            on_trace=lambda trace: setattr(self.run, "middleware_trace", list(trace)),
            retry_count=n - 1,
            max_retries=self.max_retries,
            skip_plugins=plugins_applied(self.run.env.context),
            around_execution=lambda request, chain: self.runner.execution(run, None, request, chain),
        )
        # An llm_execution middleware may answer with the provider SDK's own object (a ChatCompletion, as
        # Hermes' adapters return): the response goes on the wire as its plain data.
        dump = getattr(response, "model_dump", None)
        return dump(mode="json") if callable(dump) else response

    def _delta(self, delta: dict[str, Any]) -> None:
        self.runner.publish(self.run, DELTA, delta)

    def _pause(self, error: ProviderError) -> None:
        """Pause the key for the whole fleet as long as the provider asked, and send this call back."""
        wait = error.retry_after if error.retry_after is not None else DEFAULT_PAUSE
        info = self.run.info
        until = self.core.limiter.pause(info.call_id, info.queue, info.ckey, min(wait, self.max_retry_after))
        log.info("provider refused for its rate: key paused", status=error.status, pause_s=round(wait, 3))
        raise RateLimited(until) from error

    def _retry_in(self, error: ProviderError | ProviderTimeout, n: int) -> float:
        """Seconds before attempt ``n + 1``; raises the error that ends the call when there is none."""
        if n > self.max_retries:
            raise error
        delay = retry_delay(error, n, max_retry_after=self.max_retry_after)
        if delay is None:
            if not getattr(error, "retryable", False):
                raise error
            reason = give_up_reason(error, self.max_retry_after)  # the server asked for a wait we refuse
        elif delay < self.ctx.deadline - time.monotonic():
            return delay
        elif isinstance(error, ProviderTimeout):
            raise error
        else:
            reason = f"a retry in {delay:.1f}s would pass the call's {self.timeout:g}s timeout"
            reason += f"; giving up: {error}"
        raise ProviderError(reason, status=getattr(error, "status", None), retryable=False) from error

    def _announce_retry(self, error: ProviderError | ProviderTimeout, n: int, delay: float) -> None:
        status = getattr(error, "status", None)
        message = f"retrying after {delay:.1f}s: " + (f"{status} {error}" if status else str(error))
        log.info("llm attempt failed, retrying", attempt=n, delay_s=round(delay, 3), error=str(error))
        self.run.trace.retry(n, delay, error)
        detail = {
            "message": message,
            "attempt": n,
            "next_attempt": n + 1,
            "delay": round(delay, 3),
            "error": error.to_wire(),
        }
        self.runner.publish(self.run, PROGRESS, detail)
