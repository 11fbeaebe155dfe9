"""broker.pipes: one round trip, the same replies as redis-py's Pipeline.execute, NOSCRIPT recovery."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import ResponseError

from broker import pipes
from tests.redis_stack import data_node

# SCRIPT FLUSH and INFO commandstats are the server's, not a database's: these tests run on a redis-server
# of their own, so a flush here never lands in the middle of another test's pipeline (under pytest-xdist
# other workers share the test Redis), and one after another on one worker.
pytestmark = pytest.mark.xdist_group("redis-script-cache")


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    node = data_node(tmp_path_factory.mktemp("pipes"), "pipes").start()
    try:
        yield f"redis://127.0.0.1:{node.port}/0"
    finally:
        node.stop()


@pytest.fixture
def redis_url(private_redis: str) -> str:
    """This module's own server, flushed first (overrides tests/conftest.py's shared database)."""
    client = redis.Redis.from_url(private_redis)
    client.flushall()
    client.close()
    return private_redis

def _queue(pipe: redis.client.Pipeline) -> None:
    pipe.set("k", "v")
    pipe.get("k")
    pipe.incr("n")
    pipe.hset("h", mapping={"a": "1", "b": "2"})
    pipe.hgetall("h")
    pipe.zadd("z", {"m": 1.5})
    pipe.zrange("z", 0, -1, withscores=True)
    pipe.exists("k", "missing")
    pipe.lpush("k", "x")  # WRONGTYPE: a ResponseError in its place, the rest still runs
    pipe.config_get("maxmemory")  # a two-word command name
    pipe.delete("n")


def test_replies_match_redis_py(conn: redis.Redis) -> None:
    expected_pipe = conn.pipeline(transaction=False)
    _queue(expected_pipe)
    expected = expected_pipe.execute(raise_on_error=False)
    conn.delete("k", "n", "h", "z")

    pipe = conn.pipeline(transaction=False)
    _queue(pipe)
    got = pipes.execute(pipe)

    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        if isinstance(e, ResponseError):
            assert isinstance(g, ResponseError) and "WRONGTYPE" in str(g)
        else:
            assert g == e
    assert got[1] == b"v" and got[4] == {b"a": b"1", b"b": b"2"} and got[6] == [(b"m", 1.5)]
    assert pipe.command_stack == [], "the pipe is reset and can be reused"


def test_decoding_client(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    pipe = client.pipeline(transaction=False)
    pipe.set("s", "é")
    pipe.get("s")
    assert pipes.execute(pipe) == [True, "é"]


def test_empty_pipeline_sends_nothing(conn: redis.Redis) -> None:
    assert pipes.execute(conn.pipeline(transaction=False)) == []


def test_script_lost_by_the_server_is_loaded_and_only_refused_commands_rerun(conn: redis.Redis) -> None:
    incr_by = conn.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    pipe = conn.pipeline(transaction=False)
    incr_by(keys=["c"], args=[1], client=pipe)
    assert pipes.execute(pipe) == [1]

    conn.script_flush()  # a restarted or flushed server
    pipe = conn.pipeline(transaction=False)
    pipe.incr("plain")  # not a script: must run exactly once
    incr_by(keys=["c"], args=[10], client=pipe)
    pipe.get("c")  # runs before the rerun: still sees the old value
    incr_by(keys=["c"], args=[100], client=pipe)
    replies = pipes.execute(pipe)

    assert replies[0] == 1 and conn.get("plain") == b"1"
    assert replies[1] == 11 and replies[3] == 111, "refused commands rerun in their order"
    assert replies[2] == b"1"
    assert conn.script_exists(incr_by.sha) == [True]


def test_connection_dropped_between_pipelines_is_reopened(conn: redis.Redis, redis_url: str) -> None:
    pipe = conn.pipeline(transaction=False)
    pipe.client_id()
    (first_id,) = pipes.execute(pipe)
    killer = redis.Redis.from_url(redis_url)
    assert killer.client_kill_filter(_id=first_id) == 1
    killer.close()
    pipe = conn.pipeline(transaction=False)
    pipe.set("after", "1")
    pipe.client_id()
    ok, second_id = pipes.execute(pipe)
    assert ok is True and second_id != first_id
    assert conn.get("after") == b"1"


def test_connection_goes_back_to_the_pool(conn: redis.Redis) -> None:
    pool = conn.connection_pool
    for _ in range(20):
        pipe = conn.pipeline(transaction=False)
        pipe.ping()
        assert pipes.execute(pipe) == [True]
    assert len(pool._in_use_connections) == 0


def test_a_kept_connection_is_used_every_time_and_reopened_after_a_drop(conn: redis.Redis, redis_url: str) -> None:
    pool = conn.connection_pool
    kept = pool.get_connection()
    ids = []
    for _ in range(3):
        pipe = conn.pipeline(transaction=False)
        pipe.client_id()
        ids.extend(pipes.execute(pipe, kept))
    assert len(set(ids)) == 1 and kept in pool._in_use_connections  # never handed back by execute
    killer = redis.Redis.from_url(redis_url)
    assert killer.client_kill_filter(_id=ids[0]) == 1
    killer.close()
    pipe = conn.pipeline(transaction=False)
    pipe.set("after", "1")
    pipe.client_id()
    ok, new_id = pipes.execute(pipe, kept)
    assert ok is True and new_id != ids[0] and conn.get("after") == b"1"
    pool.release(kept)


def test_a_transaction_pipeline_is_refused_not_silently_sent_without_multi(conn: redis.Redis) -> None:
    import pytest

    pipe = conn.pipeline()  # transaction=True by default
    pipe.set("t", "1")
    with pytest.raises(ValueError, match="transaction=False"):
        pipes.execute(pipe)
    assert conn.get("t") is None


def _retrying(redis_url: str) -> redis.Redis:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 3), retry_on_error=[redis.ConnectionError])


def _failing_once(conn: redis.Redis, method: str, on_call: int, error: Exception) -> list[int]:
    """Make the pooled connection's ``method`` raise ``error`` on its ``on_call``-th use; counts the uses."""
    pool = conn.connection_pool
    c = pool.get_connection()
    real = getattr(c, method)
    uses = [0]

    def flaky(*a: object, **kw: object) -> object:
        uses[0] += 1
        if uses[0] == on_call:
            raise error
        return real(*a, **kw)

    setattr(c, method, flaky)
    pool.release(c)
    return uses


def test_a_connection_lost_after_replies_began_is_not_sent_again(redis_url: str) -> None:
    """The server ran the commands it answered: resending would run them twice, retries or not."""
    import pytest

    conn = _retrying(redis_url)
    _failing_once(conn, "read_response", 2, redis.ConnectionError("lost mid-reply"))
    pipe = conn.pipeline(transaction=False)
    pipe.incr("counter")
    pipe.incr("counter")
    with pytest.raises(redis.ConnectionError):
        pipes.execute(pipe)
    assert conn.get("counter") == b"2", "each INCR ran exactly once"


def test_a_connection_lost_before_any_reply_is_retried(redis_url: str) -> None:
    conn = _retrying(redis_url)
    sends = _failing_once(conn, "send_packed_command", 1, redis.ConnectionError("refused"))
    pipe = conn.pipeline(transaction=False)
    pipe.incr("counter")
    assert pipes.execute(pipe) == [1] and sends[0] >= 2  # (reconnecting sends its own handshake too)
    assert conn.get("counter") == b"1"


def test_script_calls_queued_straight_onto_a_pipeline_run_as_redis_pys_and_survive_a_script_flush(
    conn: redis.Redis,
) -> None:
    incr_by = conn.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    via_redis_py = conn.pipeline(transaction=False)
    incr_by(keys=["b"], args=[2], client=via_redis_py)
    ours = conn.pipeline(transaction=False)
    assert pipes.script(incr_by, ["b"], [2], ours) is ours
    assert ours.command_stack == via_redis_py.command_stack  # the same EVALSHA, queued the same way
    via_redis_py.reset()
    assert incr_by in ours.scripts  # a server that lost it is given it again
    conn.script_flush()
    assert pipes.execute(ours) == [2]
    conn.script_flush()
    pipes.script(incr_by, ["b"], [3], ours)
    assert ours.execute() == [5]  # redis-py's own execute loads the registered script too


def test_script_calls_outside_a_plain_pipeline_go_through_redis_py(conn: redis.Redis) -> None:
    incr_by = conn.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    assert pipes.script(incr_by, ["c"], [4], None) == 4  # the script's own client, at once
    assert pipes.script(incr_by, ["c"], [1], conn) == 5
    with conn.pipeline() as watching:
        watching.watch("c")  # immediate mode: the command runs now, as redis-py runs it
        assert pipes.script(incr_by, ["c"], [1], watching) == 6


def test_a_wait_behind_a_refused_script_is_sent_again_after_its_rerun(conn: redis.Redis) -> None:
    # WAIT confirms the writes its connection sent before it: a script refused (NOSCRIPT) and rerun after
    # it would go unconfirmed, so the WAIT goes again behind the rerun (its reply is the second one's).
    script = conn.register_script("return redis.call('INCR', KEYS[1])")
    conn.script_flush()
    waits = int(conn.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
    pipe = conn.pipeline(transaction=False)
    pipes.script(script, ["n"], [], pipe)
    pipe.execute_command("WAIT", 0, 100)
    pipe.set("after", "1")
    replies = pipes.execute(pipe)
    assert replies == [1, 0, True]
    assert int(conn.info("commandstats")["cmdstat_wait"]["calls"]) == waits + 2
    # Scripts already loaded: one WAIT, no rerun.
    pipe = conn.pipeline(transaction=False)
    pipes.script(script, ["n"], [], pipe)
    pipe.execute_command("WAIT", 0, 100)
    assert pipes.execute(pipe) == [2, 0]
    assert int(conn.info("commandstats")["cmdstat_wait"]["calls"]) == waits + 3


def test_with_the_fast_path_off_pipelines_go_through_redis_py_and_scripts_are_reloaded(conn: Any) -> None:
    pipes.configure(False)
    try:
        script = conn.register_script("return ARGV[1]")
        pipe = conn.pipeline(transaction=False)
        pipes.script(script, [], ["x"], pipe)
        pipe.get("hermes:test:nothing")
        conn.script_flush()  # redis-py's execute loads what the server lost
        assert pipes.execute(pipe) == [b"x", None]
    finally:
        pipes.configure(True)


def test_broker_fast_path_is_a_setting_and_a_bad_value_is_a_clear_error(tmp_path: Any, monkeypatch: Any) -> None:
    import pytest

    from broker.config import load_settings
    from broker.errors import ConfigError

    assert load_settings(str(tmp_path)).broker.fast_path is True  # the measured default (ARCHITECTURE)
    monkeypatch.setenv("HERMES_REDIS_FAST_PATH", "0")
    assert load_settings(str(tmp_path)).broker.fast_path is False
    monkeypatch.setenv("HERMES_REDIS_FAST_PATH", "maybe")
    with pytest.raises(ConfigError, match="fast_path"):
        load_settings(str(tmp_path))


# -- a cluster slot moving (issue 31) ------------------------------------------------------------


class _MovingPipe:
    """A cluster pipeline stand-in (its commands on ``_execution_strategy.command_queue``, as redis-py's)
    whose node refuses the commands named in ``refusals`` with the errors listed there, one per send."""

    def __init__(self, refusals: dict[str, list[Exception]]) -> None:
        from types import SimpleNamespace

        self._execution_strategy = SimpleNamespace(command_queue=[])
        self.refusals = refusals
        self.sent: list[list[str]] = []

    def execute_command(self, *args: Any, **options: Any) -> _MovingPipe:
        from types import SimpleNamespace

        self._execution_strategy.command_queue.append(SimpleNamespace(args=args, options=options))
        return self

    def __len__(self) -> int:
        return len(self._execution_strategy.command_queue)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack, self._execution_strategy.command_queue = self._execution_strategy.command_queue, []
        self.sent.append([c.args[1] for c in stack])
        return [(self.refusals.get(c.args[1]) or [f"ran {c.args[1]}"]).pop(0) for c in stack]


NON_LOCAL = "Script attempted to access a non local key in a cluster node script: f00, on @user_script:22."


def test_commands_a_moving_slot_refused_are_sent_again_alone_in_order_until_they_run() -> None:
    from redis.exceptions import ClusterError, TryAgainError

    pipe = _MovingPipe({"b": [TryAgainError("TRYAGAIN"), ClusterError("TTL exhausted.")], "c": [ResponseError(NON_LOCAL)]})
    for name in "abcd":
        pipe.execute_command("SET", name, "v")
    rounds: list[int] = []
    replies = pipes.stock(pipe, lambda n, _e: rounds.append(n) is None)
    assert replies == ["ran a", "ran b", "ran c", "ran d"]
    assert pipe.sent == [["a", "b", "c", "d"], ["b", "c"], ["b"]]  # the others ran: never sent twice
    assert rounds == [0, 1]  # asked before each resend


def test_refusals_stay_in_the_replies_when_keep_trying_says_stop_and_other_errors_are_never_resent() -> None:
    from redis.exceptions import AskError

    pipe = _MovingPipe({"a": [AskError("12 127.0.0.1:7001")], "b": [ResponseError("WRONGTYPE Operation")]})
    pipe.execute_command("SET", "a", "v")
    pipe.execute_command("SET", "b", "v")
    replies = pipes.stock(pipe, lambda _n, _e: False)
    assert isinstance(replies[0], AskError) and isinstance(replies[1], ResponseError)
    assert pipe.sent == [["a", "b"]]
    pipe = _MovingPipe({"b": [ResponseError("WRONGTYPE Operation")]})
    pipe.execute_command("SET", "b", "v")
    assert isinstance(pipes.stock(pipe, lambda _n, _e: True)[0], ResponseError) and pipe.sent == [["b"]]


def test_moving_names_the_refusals_of_a_migrating_slot_only() -> None:
    from redis.exceptions import (
        AskError,
        ClusterDownError,
        ClusterError,
        MovedError,
        NoScriptError,
        TryAgainError,
    )

    for e in (AskError("1 h:1"), MovedError("1 h:1"), TryAgainError("TRYAGAIN"),
              ClusterError("TTL exhausted."), ClusterDownError("CLUSTERDOWN"), ResponseError(NON_LOCAL)):  # fmt: skip
        assert pipes.moving(e), e
    for other in (ResponseError("WRONGTYPE"), NoScriptError("NOSCRIPT"), redis.ConnectionError("gone"), b"OK", 1):
        assert not pipes.moving(other), other


def test_patiently_calls_again_through_a_moving_slot_and_raises_anything_else_at_once() -> None:
    from redis.exceptions import TryAgainError

    answers: list[Any] = [TryAgainError("TRYAGAIN"), TryAgainError("TRYAGAIN"), 7]

    def call(x: int) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer + x

    assert pipes.patiently(lambda _n, _e: True, call, 1) == 8 and answers == []
    answers[:] = [ResponseError("WRONGTYPE"), 7]
    try:
        pipes.patiently(lambda _n, _e: True, call, 1)
    except ResponseError:
        pass
    assert answers == [7]  # not called again
    answers[:] = [TryAgainError("TRYAGAIN"), 7]
    try:
        pipes.patiently(lambda _n, _e: False, call, 1)
    except TryAgainError:
        pass
    assert answers == [7]


def test_with_the_fast_path_off_a_plain_pipeline_sent_with_keep_trying_goes_through_redis_py(conn: Any) -> None:
    """The client's submissions and the retry scheduler pass ``keep_trying``: on a plain Redis with
    ``broker.fast_path`` off that must not look for a cluster pipeline's queue."""
    pipes.configure(False)
    try:
        pipe = conn.pipeline(transaction=False)
        pipe.set("hermes:test:kt", "1")
        pipe.get("hermes:test:kt")
        assert pipes.execute(pipe, keep_trying=pipes.for_seconds(1)) == [True, b"1"]
    finally:
        pipes.configure(True)
