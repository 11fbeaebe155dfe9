"""A minimal agent loop over the queue (``hermes-gateway chat``): each turn is one LLM call offering the
tools the principal may call, then the tool calls of its answer, side by side on the workers (with the
session, turn, tool-call id and the LLM call as parent), their results fed back as ``tool`` messages;
until an answer without tool calls, or ``max_turns`` LLM calls.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from broker import otel
from broker.errors import DecodeError, HermesError, UnknownTool
from broker.events import DELTA
from hermes_gateway.handle import interrupt_after

if TYPE_CHECKING:
    from hermes_gateway.client import Gateway
    from hermes_gateway.handle import CallHandle

DEFAULT_MAX_TURNS = 8
DEFAULT_WAIT = 600.0  # seconds the loop waits for one call; the workers enforce the calls' own timeouts


@dataclass
class ToolRun:
    """One tool call the model asked for and what became of it."""

    tool_call_id: str
    name: str
    args: Any
    call_id: str | None = None  # None when it never reached the queue (bad arguments, unknown tool)
    result: Any = None
    error: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def content(self) -> str:
        """The ``tool`` message content the model gets back."""
        if self.error is not None:
            return json.dumps({"error": f"{self.error['type']}: {self.error['message']}"}, ensure_ascii=False)
        if isinstance(self.result, str):
            return self.result
        return json.dumps(self.result, ensure_ascii=False, default=str)


@dataclass
class Turn:
    """One LLM call and the tool calls of its answer."""

    number: int
    turn_id: str
    llm_call_id: str
    content: str | None
    tools: list[ToolRun] = field(default_factory=list)
    seconds: float = 0.0
    api_request: dict[str, str] = field(default_factory=dict)  # the answering request's context (its tool calls')


@dataclass
class ChatResult:
    """The answer (None when the turn limit came first) and how the loop got there."""

    answer: str | None
    session_id: str
    messages: list[dict[str, Any]]
    turns: list[Turn]

    @property
    def finished(self) -> bool:
        return self.answer is not None


def offered_tools(gw: Gateway, principal: str | None, only: list[str] | None = None) -> list[dict[str, Any]]:
    """The function tools to offer: those the policy lets ``principal`` call (optionally only some)."""
    schemas = gw.tool_schemas(principal)
    if only is not None:
        offered = {s["function"]["name"] for s in schemas}
        missing = [name for name in only if name not in offered]
        if missing:  # a typo would otherwise quietly offer fewer tools
            who = f" for principal {principal!r}" if principal else ""
            raise UnknownTool(
                f"no such tool{who}: {', '.join(missing)} (known: {', '.join(sorted(offered)) or 'none'})",
                tool=missing[0],
            )
        schemas = [s for s in schemas if s["function"]["name"] in only]
    return schemas


def parse_arguments(raw: Any) -> dict[str, Any]:
    """A tool call's ``arguments`` (a JSON string from the provider) as a mapping; ValueError if not one."""
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(value).__name__}")
    return value


def _error(e: BaseException) -> dict[str, Any]:
    if isinstance(e, HermesError):
        return {"type": e.type, "message": e.message}
    return {"type": "invalid_args", "message": f"the tool call's arguments are not usable: {e}"}


class ChatSession:
    """One conversation: ``ask`` runs a user message to an answer; ``messages`` carries over to the next."""

    def __init__(
        self,
        gw: Gateway,
        *,
        principal: str | None = None,
        session_id: str | None = None,
        system: str | None = None,
        model: str | None = None,
        max_turns: int = DEFAULT_MAX_TURNS,
        stream: bool = False,
        tools: list[str] | None = None,
        wait: float = DEFAULT_WAIT,
        on_delta: Callable[[str], None] | None = None,
        on_turn: Callable[[Turn], None] | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.gw = gw
        self.principal = principal
        self.session_id = session_id or f"chat-{uuid.uuid4().hex[:12]}"
        self.model = model
        self.max_turns = max_turns
        self.stream = stream
        self.only = tools
        if tools is not None:
            offered_tools(gw, principal, tools)  # an unknown name is an error now, not fewer tools later
        self.wait = wait
        self.on_delta = on_delta
        self.on_turn = on_turn
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self._turns = 0  # across asks, so turn ids stay unique within the session
        self._traceparent: str | None = None  # the question's trace when no SDK span carries it
        self._waiting: list[CallHandle] = []  # the calls the running ask waits on (cancel_waiting)

    def ask(self, query: str) -> ChatResult:
        """Run ``query`` until the model answers without tool calls or the turn limit is reached. An ask
        that raises or reaches ``max_turns`` leaves ``messages`` as it found them (the result keeps a
        copy)."""
        mark = len(self.messages)
        try:
            result = self._traced(query)
        except BaseException:
            del self.messages[mark:]
            self.cancel_waiting()  # (Ctrl-C, say: the calls this ask waits on stop too)
            raise
        finally:
            self._waiting = []
        if result.answer is None:
            result.messages = list(self.messages)
            del self.messages[mark:]
        return result

    def cancel_waiting(self) -> int:
        """Cancel the calls the running ask waits on (its LLM call or its tool calls); how many were."""
        from hermes_gateway.handle import cancel_unended

        return cancel_unended(self._waiting)

    def _traced(self, query: str) -> ChatResult:
        """One trace for the question: its LLM calls and tool calls are children of a ``chat`` span (with
        an SDK tracer), else of one traceparent made for it (or the caller's current one)."""
        tracer = otel.tracer()
        if tracer is None:
            self._traceparent = otel.headers_of()[0] or otel.ensure_traceparent(None)
            return self._ask(query)
        self._traceparent = None  # (the span is current: each call's producer span is its child)
        with tracer.start_as_current_span("chat", attributes={"session.id": self.session_id}):
            return self._ask(query)

    def _ask(self, query: str) -> ChatResult:
        self.messages.append({"role": "user", "content": query})
        schemas = offered_tools(self.gw, self.principal, self.only)
        turns: list[Turn] = []
        for n in range(1, self.max_turns + 1):
            turn = self._llm_turn(n, schemas)
            turns.append(turn)
            if turn.tools:
                started = time.monotonic()
                self._run_tools(turn)
                turn.seconds += time.monotonic() - started
                self.messages.extend(
                    {"role": "tool", "tool_call_id": r.tool_call_id, "content": r.content()} for r in turn.tools
                )
            if self.on_turn is not None:
                self.on_turn(turn)
            if not turn.tools:
                return ChatResult(turn.content or "", self.session_id, self.messages, turns)
        return ChatResult(None, self.session_id, self.messages, turns)

    def _context(self, turn_id: str, **more: Any) -> dict[str, Any]:
        context = {"session_id": self.session_id, "turn_id": turn_id, "principal": self.principal,
                   "traceparent": self._traceparent, **more}
        return {k: v for k, v in context.items() if v is not None}

    def _llm_turn(self, n: int, schemas: list[dict[str, Any]]) -> Turn:
        self._turns += 1
        turn_id = f"{self.session_id}-t{self._turns}"
        optional = {"tools": schemas, "model": self.model, "stream": self.stream}  # (sent when set)
        request = {"messages": list(self.messages), **{k: v for k, v in optional.items() if v}}
        started = time.monotonic()
        with interrupt_after():  # (a Ctrl-C right after the submission still finds the call to cancel)
            handle = self.gw.call_llm(request, **self._context(turn_id))
            self._waiting = [handle]
        if self.stream and self.on_delta is not None:
            for ev in handle.events(timeout=self.wait):
                if ev.type == DELTA and ev.detail.get("content"):
                    self.on_delta(str(ev.detail["content"]))
        response = handle.result(self.wait)
        message = _first_message(response)
        assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        calls = message.get("tool_calls") or []
        if calls:
            assistant["tool_calls"] = calls
        self.messages.append(assistant)
        turn = Turn(n, turn_id, handle.call_id, message.get("content"), seconds=time.monotonic() - started)
        # The API request that answered (its id, provider, model, api_mode): the tool calls it asks for carry
        # it, so their middleware sees the runtime context the seed lists.
        answered = handle.final.detail.get("api_request") if handle.final is not None else None
        turn.api_request = {str(k): str(v) for k, v in answered.items() if v} if isinstance(answered, dict) else {}
        for tc in calls:
            fn = tc.get("function") or {}
            turn.tools.append(ToolRun(str(tc.get("id") or ""), str(fn.get("name") or ""), fn.get("arguments")))
        return turn

    def _run_tools(self, turn: Turn) -> None:
        """Submit every tool call of the turn first, then collect: they run side by side on the workers."""
        pending: list[tuple[ToolRun, CallHandle, float]] = []
        for run in turn.tools:
            try:
                run.args = parse_arguments(run.args)
                context = self._context(
                    turn.turn_id, tool_call_id=run.tool_call_id, parent_call_id=turn.llm_call_id, **turn.api_request
                )
                with interrupt_after():
                    handle = self.gw.call_tool(run.name, run.args, **context)
                    self._waiting.append(handle)
            except (HermesError, ValueError) as e:
                run.error = _error(e)
                continue
            run.call_id = handle.call_id
            pending.append((run, handle, time.monotonic()))
        for run, handle, started in pending:
            try:
                run.result = handle.result(self.wait)
            except HermesError as e:
                run.error = _error(e)
            run.seconds = time.monotonic() - started


def _first_message(response: Any) -> dict[str, Any]:
    choices = (response or {}).get("choices") if isinstance(response, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise DecodeError(f"the provider's response has no choices: {str(response)[:200]}")
    return choices[0].get("message") or {}


def describe_turn(turn: Turn) -> list[str]:
    """Lines for ``chat --verbose``: the LLM call, then each tool call with its outcome."""
    lines = [
        f"turn {turn.number}: llm call {turn.llm_call_id} -> "
        + (f"{len(turn.tools)} tool call(s)" if turn.tools else "answer")
    ]
    for r in turn.tools:
        args = json.dumps(r.args, ensure_ascii=False, default=str) if not isinstance(r.args, str) else r.args
        outcome = r.content() if r.ok else f"error {r.content()}"
        if len(outcome) > 300:
            outcome = outcome[:300] + "…"
        lines.append(
            f"  {r.name}({args}) call {r.call_id or '-'} [{r.tool_call_id}] {r.seconds * 1000:.0f} ms -> {outcome}"
        )
    return lines
