"""``hermes-gateway chat``: a minimal agent loop over the queue, for one question or a conversation."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import click

from broker.errors import CallCancelled, CallFailed, CallTimeout, HermesError
from hermes_gateway.cli.common import (
    POSITIVE,
    WAIT_SECONDS,
    failing,
    note,
    open_gateway,
    settings_of,
    sync_tools,
)

QUIT_WORDS = ("exit", "quit")
PROMPT = "> "


def _ask_once(
    session: Any, query: str, shown: dict[str, bool], verbose: bool, max_turns: int, *, more: bool = False
) -> int:
    """Run one user message and print its answer (or ``error: ...`` on stderr); the exit code it earns.
    ``more``: other messages follow, so a stream that broke off mid-line gets its line ended first."""
    shown["answer_shown"] = False
    try:
        result = session.ask(query)
    except HermesError as e:
        if more and shown["open"]:
            click.echo("")
        shown["open"] = False
        note(f"cancelled: {e}" if isinstance(e, CallCancelled) else f"{e.type}: {e}", "error")
        return 1 if isinstance(e, (CallCancelled, CallTimeout, CallFailed)) else 2
    if verbose:
        note(f"session {result.session_id}: {len(result.turns)} LLM call(s)")
    if result.answer is None:
        note(f"no answer within {max_turns} turn(s) (--max-turns)", "error")
        return 1
    if not shown["answer_shown"]:
        click.echo(result.answer)
    return 0


def _read_message(interactive: bool) -> str | None:
    """The next line of stdin without its newline; None at end of input."""
    if interactive and sys.stdout.isatty():
        try:
            return input(PROMPT)  # line editing and history through readline
        except EOFError:
            click.echo("", err=True)
            return None
    if interactive:  # answers redirected: keep the prompt off stdout
        click.echo(PROMPT, nl=False, err=True)
    line = sys.stdin.readline()
    if not line:
        if interactive:
            click.echo("", err=True)
        return None
    return line.rstrip("\r\n")


def _conversation(session: Any, shown: dict[str, bool], verbose: bool, max_turns: int) -> int:
    """Answer stdin's lines in turn in one session; the highest exit code of any turn (0 if none failed)."""
    interactive = sys.stdin.isatty()
    if interactive:
        if sys.stdout.isatty():  # only then does input() use it (and may it write to stdout)
            with contextlib.suppress(ImportError):  # (not on every platform)
                import readline  # noqa: F401 - importing it gives input() line editing and history
        click.echo(
            f"hermes-gateway chat, session {session.session_id}. Type a message and press Enter;"
            " `exit`, `quit` or Ctrl-D to quit.",
            err=True,
        )
    code = 0
    while True:
        try:
            line = _read_message(interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave like Ctrl-D
            click.echo("", err=True)
            break
        if line is None or line.strip().lower() in QUIT_WORDS:
            break
        query = line.strip()
        if not query:
            continue
        try:
            code = max(code, _ask_once(session, query, shown, verbose, max_turns, more=True))
        except KeyboardInterrupt:  # Ctrl-C while a turn runs: end the conversation, no traceback
            return _interrupted(shown)
    return code


def _interrupted(shown: dict[str, bool]) -> int:
    """Say a Ctrl-C ended the question (ChatSession.ask cancelled its calls); exit code 130."""
    if shown["open"]:
        click.echo("")
    note("interrupted: the calls of this question were cancelled", "error")
    return 130


@click.command()
@click.option(
    "--query", "-q", default=None,
    help="Ask this one message and exit. Without it, read messages from stdin, one per line.",
)
@click.option("--max-turns", default=8, show_default=True, type=POSITIVE, help="LLM calls at most before giving up.")
@click.option("--stream", is_flag=True, help="Print the answer's text as it arrives.")
@click.option("--verbose", "-v", is_flag=True, help="Also print each LLM and tool call (to stderr).")
@click.option("--system", default=None, help="A system message.")
@click.option("--principal", default=None, help="Offer only the tools this principal may call.")
@click.option("--session-id", default=None)
@click.option("--model", default=None, help="Override model.model of config.yaml.")
@click.option("--tools", "only", default=None, help="Comma-separated tool names to offer (default: all allowed).")
@click.option("--timeout", type=WAIT_SECONDS, default=600.0, show_default=True, help="Seconds to wait for any one call.")
@click.pass_context
def chat(
    ctx: click.Context, query: str | None, max_turns: int, stream: bool, verbose: bool, system: str | None,
    principal: str | None, session_id: str | None, model: str | None, only: str | None, timeout: float,
) -> None:
    """Ask the model through the gateway; its tool calls run on the workers, in parallel.

    \b
    With --query: one message, one answer. Exit code 1 if a call failed, timed out
    or was cancelled, or no answer came within --max-turns; 2 on other errors; 130
    after Ctrl-C, which cancels the calls the question was waiting on.

    \b
    Without --query: a conversation. Each line of stdin is one message, answered in
    turn in one session (later messages see the earlier ones and their answers).
    At a terminal it shows a prompt; `exit`, `quit`, Ctrl-D or Ctrl-C end it.
    Piped (printf 'q1\\nq2\\n' | hermes-gateway chat) it prints just the answers.
    Blank lines are skipped. A failed message prints `error: ...` to stderr and the
    conversation goes on; the exit code is then the highest such code (1 or 2),
    0 if every message was answered, 130 after Ctrl-C during a call.
    """
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
                note(line)

    with open_gateway(settings_of(ctx)) as (gw, procs):
        if verbose and procs:
            note(f"broker: {gw.description}; started {len(procs)} worker for this chat")
        sync_tools(gw)
        with failing(typed=True):
            if not procs:
                gw.require_workers("llm")
            session = ChatSession(
                gw, principal=principal, session_id=session_id, system=system, model=model,
                max_turns=max_turns, stream=stream, wait=timeout, on_delta=on_delta, on_turn=on_turn,
                tools=[t.strip() for t in only.split(",") if t.strip()] if only else None,
            )
        if query is not None:
            try:
                code = _ask_once(session, query, shown, verbose, max_turns)
            except KeyboardInterrupt:  # Ctrl-C while it runs
                code = _interrupted(shown)
        else:
            code = _conversation(session, shown, verbose, max_turns)
        if code:
            sys.exit(code)
