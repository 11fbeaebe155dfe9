"""Send a redis-py pipeline with less overhead than ``Pipeline.execute``.

The hot paths (a worker's outbox flush, a client's submission) send pipelines of script calls, many per
second. redis-py's ``execute`` asks the server ``SCRIPT EXISTS`` before every pipeline that holds scripts
(one more round trip) and packs each command in Python. ``execute`` here packs with hiredis when it is
installed, sends everything in one write, assumes the scripts are loaded, and — only when the server
answers NOSCRIPT (a restart or ``SCRIPT FLUSH``) — loads them and reruns the refused commands in order.

Replies come back as ``Pipeline.execute(raise_on_error=False)`` gives them: parsed by the client's
response callbacks, a ``ResponseError`` instance in place of a command that failed.
"""

from __future__ import annotations

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
except ImportError:  # pragma: no cover - hiredis is an install dependency; redis-py packs without it
    _hiredis_pack = None

# The private path (below) is used only while this is on: ``configure(settings.broker.fast_path)``.
FAST = True

Command = tuple[tuple[Any, ...], dict[str, Any]]
# Seconds a caller's submission waits out a moving cluster slot before the refusal is its error.
SUBMIT_PATIENCE = 30.0
# Asked before each round of resending the commands a moving slot refused: (rounds so far, one of the
# errors) -> whether to go on.
KeepTrying = Callable[[int, Exception], bool]
# Told the first round's replies and which of them a moving slot refused, before those are sent again: the
# rest ran, and their replies are final.
Settled = Callable[[list[Any], set[int]], None]
_TEXT: dict[str, str] = {}  # sha -> text of every script sent through ``script`` (to resend as EVAL)
_DROP = (NEVER_DECODE, EMPTY_RESPONSE, "keys")


def configure(fast: bool) -> None:
    """Use the private path (``fast``) or redis-py's own ``Pipeline.execute`` for plain pipelines."""
    global FAST
    FAST = fast


def script(script: Any, keys: Sequence[Any], args: Sequence[Any], client: Any = None) -> Any:
    """``script(keys=keys, args=args, client=client)``, with less overhead when ``client`` is a pipeline.

    redis-py's ``Script.__call__`` goes through ``evalsha`` and ``execute_command`` (~7 µs per call on a
    small machine); the hot paths queue several scripts per call into pipelines, so the ``EVALSHA`` goes
    straight onto the stack here. The script is registered with the pipeline as redis-py does, so a
    server that lost it gets it again (``execute`` here, or ``Pipeline.execute``).
    """
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

    ``connection``: one the caller keeps for its own sending (a worker's outbox) instead of taking one
    from the pool each time; it is disconnected (and reconnects on the next send) when anything fails.
    A cluster's pipeline (no single connection) is sent by redis-py, one batch per node (``stock``,
    which resends what a moving slot refused while ``keep_trying`` says so, telling ``on_settled`` first).
    """
    if not FAST or not isinstance(pipe, Pipeline):
        return stock(pipe, keep_trying, on_settled)
    if getattr(pipe, "transaction", False) is True or pipe.explicit_transaction or pipe.watching:
        raise ValueError("pipes.execute sends plain pipelines; use pipeline(transaction=False), no WATCH")
    stack: list[Command] = list(pipe.command_stack)
    scripts = list(pipe.scripts)
    client = pipe  # the pipeline carries the client's response callbacks
    pool = pipe.connection_pool
    pipe.reset()
    if not stack:
        return []
    conn = connection if connection is not None else pool.get_connection()
    try:
        # The pool checks a connection it hands out; a kept one is found dropped (the server restarted,
        # an idle timeout) only when used, so it gets one more try when nothing was answered yet.
        replies = _round_trip(conn, client, stack, again=1 if connection is not None else 0)
        refused = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if refused:
            # A WAIT queued behind a refused script confirmed the writes before it, not the rerun: sent again.
            refused += [i for i in range(refused[0] + 1, len(stack)) if stack[i][0][0] == "WAIT" and i not in refused]
            for s in scripts:
                loaded = _round_trip(conn, client, [(("SCRIPT", "LOAD", s.script), {})])[0]
                if isinstance(loaded, Exception):
                    raise loaded
                s.sha = loaded if isinstance(loaded, str) else loaded.decode()
            again = _round_trip(conn, client, [stack[i] for i in refused])
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
    """Whether ``reply`` is a cluster's refusal while a slot moves to another node: ASK or MOVED, TRYAGAIN
    (a multi-key command or script whose keys are split between the two nodes), redis-py running out of
    redirections (``TTL exhausted``, CLUSTERDOWN), or a script meeting a key that already left (``non local
    key``: ours read every such key before their first write). The command did not run: send it again."""
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
    """``pipe.execute(raise_on_error=False)``; scripts a node refused with NOSCRIPT (it restarted, or a
    slot moved to a node that never ran them) are sent again as EVAL with their text, in order (those
    queued through ``script``, which notes them on the pipeline).

    On a cluster, commands refused because their slot is moving (``moving``) are sent again, alone and in
    their order, after a backoff (0.05 s doubling to 0.5 s), for as long as ``keep_trying`` says: redis-py
    follows a redirection, but gives up on TRYAGAIN within half a second, and a migration lasts as long as
    it takes to move the slot's keys. Only the refused commands go again: the others ran, and ``on_settled``
    gets their replies before the first resend (a worker's outbox answers those writes' callers at once).
    """
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


def _queued(pipe: Any) -> list[tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...] | None]]:
    """The commands queued on a cluster pipeline (args, options, the EVALSHA ``script`` noted), before
    sending: redis-py keeps them on its execution strategy (tests/broker/test_redis_internals.py)."""
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

    disconnect: Callable[[Exception], None] = lambda _e: conn.disconnect()  # noqa: E731
    # A connection that breaks before any reply is sent again (the server ran nothing we know of); once
    # replies came, the server ran at least those commands, and sending the lot again would run them twice.
    while True:
        try:
            return conn.retry.call_with_retry(
                send_and_read, disconnect, is_retryable=lambda _e: not replied[0]
            )
        except ConnectionError:  # (not a timeout: a slow server may have run the commands)
            if again <= 0 or replied[0]:
                raise
            again -= 1
            conn.disconnect()


def _pack(conn: Any, args: tuple[Any, ...]) -> bytes:
    name = args[0]
    # redis-py splits a multi-word command name ("SCRIPT LOAD"); hiredis would send it as one word.
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
