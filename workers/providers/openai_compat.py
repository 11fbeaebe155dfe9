"""OpenAI-compatible chat completions over httpx: DeepSeek, OpenAI, vLLM, Ollama, llama.cpp and friends.

Configured by config.yaml's ``model:`` block. One HTTP attempt per ``complete``: the worker owns retries
(``retry_delay`` on the typed errors raised here).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import structlog

from broker.errors import CallCancelled, ConfigError, ProviderError, ProviderTimeout
from broker.logs import secret_values
from broker.settings import ModelSettings

from .backoff import is_retryable_status, pause_seconds
from .exchange import Exchange
from .provider import ProviderContext, base_url_of
from .stream import DONE, StreamAssembler, public_delta, sse_data

log = structlog.get_logger(__name__)

# Keys of the provider kwargs that steer the client rather than go into the JSON body.
_CLIENT_KEYS = ("extra_body", "extra_headers", "extra_query", "timeout")
_MAX_ERROR_TEXT = 500


class OpenAICompatProvider:
    """Chat completions against one OpenAI-compatible endpoint; one pooled httpx client, thread-safe."""

    def __init__(
        self,
        base_url: str,
        api_key: str = "",
        model: str = "",
        timeout: float = 120.0,
        max_retries: int = 2,
        headers: dict[str, str] | None = None,
        api_key_unset: str = "",
    ) -> None:
        if not base_url:
            raise ConfigError(
                "model.base_url is required for an openai-compatible provider (ollama, vllm, lmstudio, "
                "llamacpp and deepseek as model.provider have a default address)"
            )
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self._api_key = api_key
        self._api_key_unset = api_key_unset  # the unset variable model.api_key named (said on a 401/403)
        self._headers = {"User-Agent": "hermes-gateway", **(headers or {})}
        # What an error text must never show: the key, and model.headers' secret-named values ("api-key: ...",
        # "Authorization: Bearer ...": the value and its last word), longest first.
        named = secret_values(self._headers)
        found = {api_key, *named, *(v.rsplit(" ", 1)[-1] for v in named)}
        self._secrets = sorted((v for v in found if len(v) >= 4), key=len, reverse=True)
        self._client = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(self.timeout, connect=min(10.0, self.timeout)),
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=100),
        )

    def __repr__(self) -> str:
        return f"OpenAICompatProvider(base_url={self.base_url!r}, model={self.model!r})"

    def complete(self, request: dict[str, Any], ctx: ProviderContext) -> dict[str, Any]:
        """Run one chat-completions request; for ``stream: true`` feed ``ctx.on_delta`` and assemble."""
        ctx.check()
        body, headers = self._build(request, ctx)
        ex = Exchange(ctx)
        ex.start(lambda e: self._exchange(e, body, headers))
        try:
            return self._collect(ex, ctx, bool(body.get("stream")))
        except BaseException:
            ex.abort()  # a no-op once the reader has handed over its last item
            raise

    def _collect(self, ex: Exchange, ctx: ProviderContext, stream: bool) -> dict[str, Any]:
        assembler = StreamAssembler()
        while True:
            kind, value = ex.next()
            if kind == "error":
                raise value
            if kind == "json":
                completion = self._checked(value)
                if stream:  # the server ignored stream: true; still give subscribers the text
                    for delta in _deltas_of(completion):
                        self._emit(ctx, delta)
                return completion
            if kind == "chunk":
                chunk = self._checked(value)
                try:
                    deltas = assembler.add(chunk)
                except (AttributeError, TypeError, ValueError):  # (a choice, delta or tool call of another shape)
                    text = json.dumps(chunk, ensure_ascii=False)[:_MAX_ERROR_TEXT]
                    message = self._scrub(f"provider sent a malformed stream chunk: {text}")
                    raise ProviderError(message, retryable=False) from None
                for delta in deltas:
                    self._emit(ctx, delta)
            elif kind == "end":
                return assembler.result()

    def _build(self, request: dict[str, Any], ctx: ProviderContext) -> tuple[dict[str, Any], dict[str, str]]:
        body = {k: v for k, v in request.items() if k not in _CLIENT_KEYS}
        body.update(request.get("extra_body") or {})
        if not body.get("model"):
            if not self.model:
                raise ProviderError("no model in the request and no model.model configured", retryable=False)
            body["model"] = self.model
        options = body.get("stream_options") or {}
        if body.get("stream") and isinstance(options, dict):  # (a stream's usage comes only when asked for:
            body["stream_options"] = {**options, "include_usage": True}  # budgets and limits count it)
        headers = dict(self._headers)
        headers["Accept"] = "text/event-stream" if body.get("stream") else "application/json"
        headers["X-Hermes-Call-Id"] = ctx.call_id
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        if ctx.traceparent:
            headers["traceparent"] = ctx.traceparent
        if ctx.tracestate:
            headers["tracestate"] = ctx.tracestate
        headers.update({str(k): str(v) for k, v in (request.get("extra_headers") or {}).items()})
        return body, headers

    def _emit(self, ctx: ProviderContext, delta: dict[str, Any]) -> None:
        if ctx.on_delta is None:
            return
        try:
            ctx.on_delta(delta)
        except (CallCancelled, ProviderTimeout):
            raise
        except Exception as e:  # noqa: BLE001 - a broken event sink must not fail the LLM call
            log.warning("llm.delta_sink_failed", call_id=ctx.call_id, error=repr(e))

    def _exchange(self, ex: Exchange, body: dict[str, Any], headers: dict[str, str]) -> None:
        """On the reader thread: send the request, hand the response over to ``ex``."""
        timeout = httpx.Timeout(ex.ctx.timeout, connect=min(10.0, ex.ctx.timeout))
        try:
            with self._client.stream(
                "POST", "/chat/completions", json=body, headers=headers, timeout=timeout
            ) as resp:
                ex.attach(resp)
                ex.ctx.status_code = resp.status_code  # (the audit record's status code)
                if ex.ctx.on_response is not None:
                    try:
                        ex.ctx.on_response()
                    except Exception as e:  # noqa: BLE001 - bookkeeping must not fail the call
                        log.warning("llm.on_response_failed", error=repr(e))
                if ex.stop.is_set():
                    return
                if resp.status_code >= 400:
                    resp.read()
                    ex.put("error", self._http_error(resp))
                    return
                if "event-stream" not in resp.headers.get("content-type", ""):
                    resp.read()
                    ex.put("json", self._json(resp.text, "response"))
                    return
                ended = False
                for data in sse_data(resp.iter_lines()):
                    if ex.stop.is_set():
                        return
                    if ended:
                        continue  # drain to the end of the body so the connection can be reused
                    if data.strip() == DONE:
                        ended = True
                        ex.put("end")
                        continue
                    ex.put("chunk", self._json(data, "stream chunk"))
                if not ended:  # some servers just close the stream without [DONE]
                    ex.put("end")
        except BaseException as e:  # noqa: BLE001 - everything is handed to the caller, typed
            if not ex.stop.is_set():
                ex.put("error", self._map_exception(e))

    def _json(self, text: str, what: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return ProviderError(
                self._scrub(f"provider sent a {what} that is not JSON: {text[:_MAX_ERROR_TEXT]!r}"),
                retryable=False,
            )

    def _checked(self, value: Any) -> dict[str, Any]:
        if isinstance(value, ProviderError):
            raise value
        if not isinstance(value, dict):
            raise ProviderError(f"provider sent {type(value).__name__}, not a JSON object", retryable=False)
        if "error" in value and not value.get("choices"):
            raise self._body_error(value["error"])
        return value

    def _body_error(self, error: Any) -> ProviderError:
        """An error object sent with HTTP 200 (mid-stream, or by a proxy)."""
        info = error if isinstance(error, dict) else {"message": str(error)}
        code = info.get("code")
        status = code if isinstance(code, int) else None
        retryable = is_retryable_status(status) if status is not None else True
        text = self._scrub(f"provider error: {info.get('message') or info}")
        details: dict[str, Any] = {"code": str(code)} if code and status is None else {}
        return ProviderError(text, status=status, retryable=retryable, **details)

    def _http_error(self, resp: httpx.Response) -> ProviderError:
        status = resp.status_code
        message, code = _error_message(resp)
        details: dict[str, Any] = {"code": code} if code else {}
        if status in (401, 403) and self._api_key_unset:
            message += (f" (model.api_key reads ${{{self._api_key_unset}}}, which is not set in this worker's "
                        "environment: no key was sent)")
        return ProviderError(
            self._scrub(f"provider returned HTTP {status}: {message}"),
            status=status,
            retry_after=pause_seconds(resp.headers),
            retryable=is_retryable_status(status),
            **details,
        )

    def _map_exception(self, e: BaseException) -> BaseException:
        if isinstance(e, ProviderError | CallCancelled):
            return e
        if isinstance(e, httpx.TimeoutException):
            return ProviderTimeout(self._scrub(f"provider at {self.base_url} timed out: {type(e).__name__}"))
        if isinstance(e, httpx.TransportError):
            return ProviderError(
                self._scrub(f"cannot talk to provider at {self.base_url}: {type(e).__name__}: {e}"),
                retryable=True,
            )
        return ProviderError(self._scrub(f"provider call failed: {type(e).__name__}: {e}"), retryable=False)

    def _scrub(self, text: str) -> str:
        """Never let the key (or a secret header) out, even if a server or an exception echoes it back."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()


def _error_message(resp: httpx.Response) -> tuple[str, str | None]:
    """The server's own error message (OpenAI shape, or plain text), and its error code if any."""
    try:
        data = resp.json()
    except ValueError:
        return (resp.text.strip()[:_MAX_ERROR_TEXT] or resp.reason_phrase), None
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        message = err.get("message") or err.get("detail") or json.dumps(err)[:_MAX_ERROR_TEXT]
        code = err.get("code") or err.get("type")
        return str(message)[:_MAX_ERROR_TEXT], str(code) if code else None
    return str(err)[:_MAX_ERROR_TEXT], None


def _deltas_of(completion: dict[str, Any]) -> list[dict[str, Any]]:
    """One delta per choice of a whole completion (for servers that ignore ``stream: true``)."""
    return [
        public_delta(c.get("index", 0), c.get("message") or {}, c.get("finish_reason"))
        for c in completion.get("choices") or []
    ]


def create(settings_model: ModelSettings) -> OpenAICompatProvider:
    """Build the provider from the ``model:`` settings."""
    return OpenAICompatProvider(
        base_url=base_url_of(settings_model),
        api_key=settings_model.api_key,
        model=settings_model.model,
        timeout=settings_model.timeout,
        max_retries=settings_model.max_retries,
        headers=dict(settings_model.headers),
        api_key_unset=settings_model.api_key_unset,
    )
