"""What the plugin does inside the Hermes agent: gateway tools as Hermes tools, LLM calls via the queue.

A tool handler gets only ``task_id``/``session_id``; the model's ids for the tool call reach the
``tool_execution`` middleware, which hands them down the chain (same thread) in a context variable.
``llm_execution`` returns what the provider client would: an OpenAI SDK ``ChatCompletion``.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import structlog

from broker.config import AgentPluginSettings, PluginDiscovery, Settings, load_settings
from broker.errors import BrokerUnavailable, CallCancelled, CallTimeout, HermesError, NoWorkers
from broker.toolspec import TOOL_NAME

log = structlog.get_logger("hermes.plugin")

PLUGIN_NAME = "hermes-gateway"
TOOLSET = "hermes-gateway"
# The model's ids for the tool call being run on this thread, set by the tool_execution middleware.
_TOOL_CALL: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "hermes_gateway_tool_call", default=None
)
_IDS = ("session_id", "task_id", "turn_id", "tool_call_id", "api_request_id")
# Provider kwargs that configure Hermes' HTTP client rather than the request (and may not be serialisable).
_CLIENT_ONLY = frozenset({"timeout"})


Options = AgentPluginSettings  # (``settings.agent_plugin``: HERMES_GATEWAY_* over plugins.entries)


def request_body(request: dict[str, Any]) -> dict[str, Any]:
    """The provider kwargs as they can travel (msgpack): client-only and unserialisable values left out."""
    body = {}
    for key, value in request.items():
        if key in _CLIENT_ONLY:
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            log.debug("provider kwarg not sent through the gateway", key=key, type=type(value).__name__)
            continue
        body[key] = value
    return body


_PLUGINS_TTL = 5.0  # seconds a plugin list is reused (Hermes reloads plugins rarely; outside it, a disk scan)
_plugins_seen: dict[Path, tuple[float, str]] = {}  # HERMES_HOME -> (when read, the list)


def agent_plugins(settings: Settings) -> str:
    """The plugins this agent runs itself, comma-separated, for the workers to skip (each runs once per
    call): what Hermes loaded, else HERMES_HOME's enabled ones; read again after ``_PLUGINS_TTL`` s."""
    home, now = settings.home, time.monotonic()
    seen = _plugins_seen.get(home)
    if seen is None or now - seen[0] >= _PLUGINS_TTL:
        seen = _plugins_seen[home] = (now, _read_agent_plugins(home, settings.plugin_discovery))
    return seen[1]


def _read_agent_plugins(home: Path, discovery: PluginDiscovery) -> str:
    keys: set[str] = set()
    try:
        from hermes_cli.plugins import get_plugin_manager

        for info in get_plugin_manager().list_plugins():
            if info.get("enabled") and (info.get("middleware") or info.get("hooks")):
                keys.update(str(info[k]) for k in ("key", "name") if info.get(k))
    except Exception:  # noqa: BLE001 - not inside Hermes (or another version): read the config instead
        from middleware import list_plugins

        keys.update(info.key for info in list_plugins(home, discovery=discovery) if info.enabled)
    keys.discard(PLUGIN_NAME)
    return ",".join(sorted(keys))


WAIT_SLICE = 0.5  # seconds between looks at the agent's interrupt flag while a call runs


def agent_interrupted() -> bool:
    """Whether the agent asked this thread's tool to stop (Hermes' ``tools.interrupt``; False outside Hermes)."""
    try:
        from tools.interrupt import is_interrupted

        return bool(is_interrupted())
    except Exception:  # noqa: BLE001 - not inside Hermes (or another version): never break a call
        return False


def as_completion(response: Any) -> Any:
    """Our chat.completion dict as the OpenAI SDK object Hermes' transport reads (attributes, not keys)."""
    try:
        from openai.types.chat import ChatCompletion

        return ChatCompletion.model_validate(response)
    except Exception:  # noqa: BLE001 - no SDK, or a shape it refuses: attribute access is all Hermes needs
        return _namespace(response)


def _namespace(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_namespace(v) for v in value]
    return value


class Bridge:
    """One gateway client per agent process, shared by every tool handler and the middleware."""

    def __init__(self, options: Options, settings: Settings | None = None) -> None:
        self.options = options
        self.settings = settings or load_settings()
        self.names: dict[str, str] = {}  # Hermes tool name -> gateway tool name
        self._gw: Any = None
        self._lock = threading.Lock()
        self._last_llm: dict[str, str] = {}  # session -> its latest LLM call id (its tool calls' parent)
        self._waiting: set[Any] = set()  # handles a thread of the agent waits on (cancelled on close)
        self._waiting_lock = threading.Lock()

    @property
    def gw(self) -> Any:
        with self._lock:
            if self._gw is None:
                from hermes_gateway.client import Gateway

                # check_workers: a call to a queue no worker listens on is refused at once (NoWorkers).
                self._gw = Gateway.connect(self.options.url, embedded_ok=False, check_workers=True)
            return self._gw

    def close(self) -> None:
        """Cancel the calls still waited on (the agent is exiting), then disconnect."""
        with self._waiting_lock:
            waiting, self._waiting = list(self._waiting), set()
        for handle in waiting:
            self._abandon(handle)
        with self._lock:
            if self._gw is not None:
                self._gw.close()
                self._gw = None

    def wait(self, handle: Any) -> Any:
        """``handle.result()`` within the timeout. Any other way out (the timeout, the agent's interrupt,
        KeyboardInterrupt, an error, ``close``) cancels the call: it must not run (or be billed) unseen."""
        deadline = time.monotonic() + self.options.timeout
        with self._waiting_lock:
            self._waiting.add(handle)
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    return handle.result(max(0.0, min(WAIT_SLICE, left)))
                except (CallTimeout, BrokerUnavailable):
                    if time.monotonic() >= deadline:
                        raise CallTimeout(
                            f"no result for call {handle.call_id} ({handle.name}) within {self.options.timeout:g}s",
                            call_id=handle.call_id,
                        ) from None
                if agent_interrupted():
                    raise CallCancelled(f"call {handle.call_id} ({handle.name}) interrupted by the agent")
        finally:
            with self._waiting_lock:
                self._waiting.discard(handle)
            if not handle.done():
                self._abandon(handle)

    @staticmethod
    def _abandon(handle: Any) -> None:
        try:
            handle.cancel()
        except Exception as e:  # noqa: BLE001 - the way out goes on; the broker may be the trouble
            log.warning("could not cancel a call the agent stopped waiting for", call_id=handle.call_id, error=str(e))

    def tools(self) -> list[tuple[str, dict[str, Any]]]:
        """(Hermes name, Hermes schema) of every gateway tool the principal may call."""
        out = []
        for tool in self.gw.tool_schemas(self.options.principal):
            fn = tool["function"]
            name = f"{self.options.tool_prefix}{fn['name']}"
            if not TOOL_NAME.fullmatch(name):  # a provider refuses the whole request over one such name
                log.warning(f"hermes-gateway plugin: tool {fn['name']!r} left out: {name!r} is no function name a "
                            "provider takes (at most 64 of A-Z a-z 0-9 _ -); see tool_prefix", plugin=PLUGIN_NAME)
                continue
            self.names[name] = fn["name"]
            out.append((name, {**fn, "name": name}))
        return out

    def handler(self, name: str) -> Callable[..., str]:
        """The Hermes handler of tool ``name``: run it on the workers, return its result as text."""

        def run(args: dict[str, Any], **kw: Any) -> str:
            return self.call(name, args, kw)

        run.__name__ = f"gateway_{name}"
        return run

    def _context(self, ids: dict[str, Any]) -> dict[str, str]:
        """A call's context: the agent's ids given, the principal, the plugins the agent runs itself."""
        context = {k: str(v) for k, v in ids.items() if v}
        if self.options.principal:
            context["principal"] = self.options.principal
        applied = agent_plugins(self.settings)
        if applied:
            context["plugins_applied"] = applied
        return context

    def call(self, name: str, args: dict[str, Any], kw: dict[str, Any]) -> str:
        ids = {"session_id": kw.get("session_id"), "task_id": kw.get("task_id"), **(_TOOL_CALL.get() or {})}
        context = self._context(ids)
        if self.options.tool_prefix:  # Hermes ran its plugins on the prefixed name: one matching the tool by
            context.pop("plugins_applied", None)  # name did not apply there, so the workers run them all
        parent = self._last_llm.get(context.get("session_id", ""))
        if parent:
            context["parent_call_id"] = parent
        try:
            handle = self.gw.call_tool(self.names.get(name, name), args or {}, **context)
            result = self.wait(handle)
        except HermesError as e:
            return json.dumps({"error": f"{e.type}: {e.message}"}, ensure_ascii=False)
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)

    def tool_execution(self, tool_name: str = "", args: Any = None, next_call: Any = None, **kw: Any) -> Any:
        """Middleware: hand the model's ids for this tool call to our handler below in the chain."""
        if tool_name not in self.names:
            return next_call(args)
        token = _TOOL_CALL.set({k: str(kw[k]) for k in _IDS if kw.get(k)})
        try:
            return next_call(args)
        finally:
            _TOOL_CALL.reset(token)

    def llm_execution(self, request: Any = None, next_call: Any = None, **kw: Any) -> Any:
        """Middleware: run the provider call on the gateway's ``llm`` queue instead of in the agent."""
        if kw.get("api_mode") not in (None, "", "chat_completions") or not isinstance(request, dict):
            return next_call(request)  # only chat-completions requests travel the queue
        ids = ("session_id", "task_id", "turn_id", "api_request_id", "provider", "platform")
        context = self._context({k: kw.get(k) for k in ids})
        body = request_body(request)
        # (Hermes streams inside its client call: a streaming worker publishes the deltas as events)
        body.setdefault("stream", True)
        if body["stream"]:
            body.setdefault("stream_options", {"include_usage": True})
        # A raise makes Hermes log it and call the provider itself: only when the gateway cannot take the call
        # (NoWorkers, no broker). One it refused or ran (a provider error, a budget, a limit) is answered as a
        # failed provider response, which Hermes reports and retries through this middleware.
        try:
            handle = self.gw.call_llm(body, **context)
            self._last_llm[context.get("session_id", "")] = handle.call_id
            return as_completion(self.wait(handle))
        except (NoWorkers, BrokerUnavailable):
            raise
        except HermesError as e:
            log.warning("LLM call failed on the gateway", error=e.type, message=e.message)
            error = {"message": f"{e.type}: {e.message}", "code": e.details.get("status")}
            return SimpleNamespace(choices=[], model=None, usage=None, error=error)
