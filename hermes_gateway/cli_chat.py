"""``hermes-gateway chat``: a minimal agent loop over the queue."""

from __future__ import annotations

from typing import Any

import click

from broker.errors import CallCancelled, CallFailed, CallTimeout, HermesError
from hermes_gateway.cli_common import _fail, _gateway, _settings

# -- chat: a minimal agent loop over the queue (hermes_gateway/chat.py) ---------------------------


@click.command()
@click.option("--query", "-q", required=True, help="The user message.")
@click.option("--max-turns", default=8, show_default=True, help="LLM calls at most before giving up.")
@click.option("--stream", is_flag=True, help="Print the answer's text as it arrives.")
@click.option("--verbose", "-v", is_flag=True, help="Also print each LLM and tool call (to stderr).")
@click.option("--system", default=None, help="A system message.")
@click.option("--principal", default=None, help="Offer only the tools this principal may call.")
@click.option("--session-id", default=None)
@click.option("--model", default=None, help="Override model.model of config.yaml.")
@click.option("--tools", "only", default=None, help="Comma-separated tool names to offer (default: all allowed).")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for any one call.")
@click.pass_context
def chat(
    ctx: click.Context, query: str, max_turns: int, stream: bool, verbose: bool, system: str | None,
    principal: str | None, session_id: str | None, model: str | None, only: str | None, timeout: float,
) -> None:
    """Ask the model through the gateway; its tool calls run on the workers, in parallel."""
    from hermes_gateway.chat import ChatSession, describe_turn

    # "open": deltas printed and the line not yet ended; "answer_shown": the final answer was streamed.
    shown = {"open": False, "answer_shown": False}

    def on_delta(text: str) -> None:
        shown["open"] = True
        click.echo(text, nl=False)

    def on_turn(turn: Any) -> None:
        shown["answer_shown"] = shown["open"] and not turn.tools
        if shown["open"]:
            click.echo("")
            shown["open"] = False
        if verbose:
            for line in describe_turn(turn):
                click.echo(line, err=True)

    settings = _settings(ctx)
    with _gateway(settings) as (gw, procs):
        if verbose and procs:
            click.echo(f"broker: {gw.description}; started {len(procs)} worker for this chat", err=True)
        gw.sync_tools()
        try:
            if not procs:
                gw.require_workers("llm")
            session = ChatSession(
                gw, principal=principal, session_id=session_id, system=system, model=model,
                max_turns=max_turns, stream=stream, wait=timeout, on_delta=on_delta, on_turn=on_turn,
                tools=[t.strip() for t in only.split(",") if t.strip()] if only else None,
            )
            result = session.ask(query)
        except CallCancelled as e:
            _fail(f"cancelled: {e}", 1)
        except (CallTimeout, CallFailed) as e:
            _fail(f"{e.type}: {e}", 1)
        except HermesError as e:
            _fail(f"{e.type}: {e}")
        if verbose:
            click.echo(f"session {result.session_id}: {len(result.turns)} LLM call(s)", err=True)
        if result.answer is None:
            _fail(f"no answer within {max_turns} turn(s) (--max-turns)", 1)
        if not shown["answer_shown"]:
            click.echo(result.answer)

