"""Send a redis-py pipeline with less overhead than ``Pipeline.execute``.

redis-py's ``execute`` asks ``SCRIPT EXISTS`` before every pipeline that holds scripts (one more round
trip) and packs each command in Python. ``execute`` here packs with hiredis, sends everything in one write,
assumes the scripts are loaded and, only when the server answers NOSCRIPT, loads them and reruns the
refused commands in order. Replies come back as ``Pipeline.execute(raise_on_error=False)`` gives them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.client import EMPTY_RESPONSE, NEVER_DECODE, Pipeline
from redis.cluster import ClusterPipeline
from redis.exceptions import (
    AskError,
    ClusterError,
    ConnectionError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is an install dependency
    _hiredis_pack = None

# The private path (below) is used only while this is on: ``configure(settings.broker.fast_path)``.
FAST = True

Command = tuple[tuple[Any, ...], dict[str, Any]]
# Seconds a caller's submission waits out a moving cluster slot before the refusal is its error.
SUBMIT_PATIENCE = 30.0
# (rounds so far, one of the errors) -> whether to resend what a moving slot refused.
KeepTrying = Callable[[int, Exception], bool]
# Told the first round's replies and which of them a moving slot refused (the rest are final).
Settled = Callable[[list[Any], set[int]], None]
_TEXT: dict[str, str] = {}  # sha -> text of every script sent through ``script`` (to resend as EVAL)
_DROP = (NEVER_DECODE, EMPTY_RESPONSE, "keys")


def configure(fast: bool) -> None:
    """Use the private path (``fast``) or redis-py's own ``Pipeline.execute`` for plain pipelines."""
    global FAST
    FAST = fast


def script(script: Any, keys: Sequence[Any], args: Sequence[Any], client: Any = None) -> Any:
    """``script(keys=keys, args=args, client=client)``, with the ``EVALSHA`` put straight onto the stack
    when ``client`` is a pipeline (registered with it as redis-py does, so a server that lost it gets it
    again)."""
    _TEXT.setdefault(script.sha, script.script)
    if FAST and type(client) is Pipeline and not client.watching:
        client.scripts.add(script)
        client.command_stack.append((("EVALSHA", script.sha, len(keys), *keys, *args), {}))
        return client
    if isinstance(client, ClusterPipeline):
        # A cluster's pipeline: queued as EVALSHA and noted, so ``stock`` can resend it as EVAL.
        noted = client.__dict__.setdefault("hermes_evals", {})
        noted[len(client)] = (script.sha, len(keys), *keys, *args)
        return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    return script(keys=keys, args=args, client=client)


def execute(
    pipe: Pipeline, connection: Any = None, keep_trying: KeepTrying | None = None, on_settled: Settled | None = None
) -> list[Any]:
    """Send ``pipe``'s queued commands in one round trip and return their replies; the pipe is reset.
    ``connection``: one the caller keeps (a worker's outbox), disconnected when anything fails. A cluster's
    pipeline is sent by ``stock``."""
    if not FAST or not isinstance(pipe, Pipeline):
        return stock(pipe, keep_trying, on_settled)
    if getattr(pipe, "transaction", False) is True or pipe.explicit_transaction or pipe.watching:
        raise ValueError("pipes.execute sends plain pipelines; use pipeline(transaction=False), no WATCH")
    stack: list[Command] = list(pipe.command_stack)
    scripts = list(pipe.scripts)
    pool = pipe.connection_pool
    pipe.reset()
    if not stack:
        return []
    conn = connection if connection is not None else pool.get_connection()
    try:
        # A kept connection is found dropped only when used: one more try while nothing was answered.
        replies = _round_trip(conn, pipe, stack, again=1 if connection is not None else 0)
        refused = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if refused:
            # A WAIT queued behind a refused script confirmed the writes before it, not the rerun: sent again.
            refused += [i for i in range(refused[0] + 1, len(stack)) if stack[i][0][0] == "WAIT" and i not in refused]
            for s in scripts:
                loaded = _round_trip(conn, pipe, [(("SCRIPT", "LOAD", s.script), {})])[0]
                if isinstance(loaded, Exception):
                    raise loaded
                s.sha = loaded if isinstance(loaded, str) else loaded.decode()
            again = _round_trip(conn, pipe, [stack[i] for i in refused])
            for i, reply in zip(refused, again, strict=True):
                replies[i] = reply
        return replies
    except BaseException:
        conn.disconnect()  # replies may be left unread on the socket: never hand it out again as is
        raise
    finally:
        if connection is None:
            pool.release(conn)


def moving(reply: Any) -> bool:
    """Whether ``reply`` is a cluster's refusal while a slot moves to another node (ASK, MOVED, TRYAGAIN,
    CLUSTERDOWN, redirections exhausted, or a script meeting a key that already left): the command did not
    run, send it again."""
    if isinstance(reply, (AskError, TryAgainError, ClusterError)):  # (MovedError, ClusterDownError: subclasses)
        return True
    return isinstance(reply, ResponseError) and "non local key" in str(reply)


def patiently(keep_trying: KeepTrying, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, called again after a backoff while it fails because a cluster slot is moving
    (``moving``: it did not run) and ``keep_trying`` says so."""
    delay, rounds = 0.05, 0
    while True:
        try:
            return call(*args)
        except (AskError, TryAgainError, ClusterError, ResponseError) as e:
            if not moving(e) or not keep_trying(rounds, e):
                raise
        rounds += 1
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def for_seconds(seconds: float) -> KeepTrying:
    """A ``keep_trying`` that goes on for ``seconds`` from now."""
    until = time.monotonic() + seconds
    return lambda _rounds, _e: time.monotonic() < until


def settled(pipe: Any, keep_trying: KeepTrying) -> list[Any]:
    """``pipe.execute()`` (the first error raised), riding out a slot migration on a cluster as ``stock``."""
    if not isinstance(pipe, ClusterPipeline):
        return pipe.execute()  # type: ignore[no-any-return]
    replies = stock(pipe, keep_trying)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def stock(pipe: Any, keep_trying: KeepTrying | None = None, on_settled: Settled | None = None) -> list[Any]:
    """``pipe.execute(raise_on_error=False)``; scripts queued through ``script`` that a node refused with
    NOSCRIPT are sent again as EVAL. On a cluster, commands refused because their slot is moving are sent
    again, in order, after a backoff, while ``keep_trying`` says so (redis-py gives up on TRYAGAIN within
    half a second); ``on_settled`` gets the other replies before the first resend."""
    if isinstance(pipe, Pipeline):
        keep_trying = None  # (only a cluster's slots move: a plain pipeline has nothing to send again)
    queued = _queued(pipe) if keep_trying is not None else []
    replies = _stock_once(pipe)
    delay, rounds = 0.05, 0
    while keep_trying is not None:
        refused = [i for i, r in enumerate(replies) if moving(r)]
        if not refused or not keep_trying(rounds, replies[refused[0]]):
            break
        if rounds == 0 and on_settled is not None:
            on_settled(list(replies), set(refused))
        rounds += 1
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
        evals: dict[int, tuple[Any, ...]] = {}
        for i in refused:
            args, options, noted = queued[i]
            if noted is not None:
                evals[len(pipe)] = noted
            pipe.execute_command(*args, **options)
        pipe.hermes_evals = evals
        for i, reply in zip(refused, _stock_once(pipe), strict=True):
            replies[i] = reply
    return replies


async def resent(pipe: Any, keep_trying: KeepTrying) -> list[Any]:
    """``await pipe.execute(raise_on_error=False)``; on an asyncio cluster pipeline, what a moving slot
    refused is sent again as ``stock`` does (redis-py's asyncio client too gives up within half a second)."""
    strategy = getattr(pipe, "_execution_strategy", None)  # (a plain pipeline has none: nothing moves)
    queued = [(c.args, c.kwargs) for c in strategy._command_queue] if strategy is not None else []
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    delay, rounds = 0.05, 0
    while queued:
        refused = [i for i, r in enumerate(replies) if moving(r)]
        if not refused or not keep_trying(rounds, replies[refused[0]]):
            break
        rounds += 1
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)
        for i in refused:
            pipe.execute_command(*queued[i][0], **queued[i][1])
        for i, reply in zip(refused, await pipe.execute(raise_on_error=False), strict=True):
            replies[i] = reply
    return replies


def _queued(pipe: Any) -> list[tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...] | None]]:
    """The commands queued on a cluster pipeline (args, options, the EVALSHA ``script`` noted), before
    sending (tests/broker/test_redis_internals.py pins where redis-py keeps them)."""
    noted: dict[int, tuple[Any, ...]] = getattr(pipe, "hermes_evals", {})
    stack = pipe._execution_strategy.command_queue
    return [(tuple(c.args), dict(c.options), noted.get(i)) for i, c in enumerate(stack)]


def _stock_once(pipe: Any) -> list[Any]:
    noted: dict[int, tuple[Any, ...]] = getattr(pipe, "hermes_evals", {})
    pipe.hermes_evals = {}
    replies = pipe.execute(raise_on_error=False)
    refused = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError) and i in noted]
    if refused:
        for i in refused:
            sha, *rest = noted[i]
            pipe.execute_command("EVAL", _TEXT[sha], *rest)
        for i, reply in zip(refused, pipe.execute(raise_on_error=False), strict=True):
            replies[i] = reply
    return replies


def _round_trip(conn: Any, client: Pipeline, stack: Sequence[Command], again: int = 0) -> list[Any]:
    """Send and read once, retried as the connection's retry policy says, plus ``again`` more times."""
    replied = [False]

    def send_and_read() -> list[Any]:
        replied[0] = False
        conn.send_packed_command([b"".join(_pack(conn, args) for args, _ in stack)])
        out = []
        for args, options in stack:
            out.append(_read(conn, client.response_callbacks, args[0], options))
            replied[0] = True
        return out

    # Sent again only while no reply came: after one, resending the lot would run commands twice.
    while True:
        try:
            return conn.retry.call_with_retry(
                send_and_read, lambda _e: conn.disconnect(), is_retryable=lambda _e: not replied[0]
            )
        except ConnectionError:  # (not a timeout: a slow server may have run the commands)
            if again <= 0 or replied[0]:
                raise
            again -= 1
            conn.disconnect()


def _pack(conn: Any, args: tuple[Any, ...]) -> bytes:
    name = args[0]
    # (hiredis would send a multi-word command name, "SCRIPT LOAD", as one word)
    if _hiredis_pack is not None and isinstance(name, str) and " " not in name:
        try:
            return _hiredis_pack(args)
        except TypeError:
            pass
    return b"".join(conn.pack_command(*args))


def _read(conn: Any, callbacks: dict[Any, Any], name: Any, options: dict[str, Any]) -> Any:
    try:
        reply = conn.read_response(disable_decoding=NEVER_DECODE in options)
    except ResponseError as e:
        return options[EMPTY_RESPONSE] if EMPTY_RESPONSE in options else e
    callback = callbacks.get(name)
    if callback is None:
        return reply
    return callback(reply, **{k: v for k, v in options.items() if k not in _DROP})
