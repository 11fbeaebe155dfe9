"""One test per private attribute of redis-py that the fast path uses (``broker.fast_path``, on a plain
Redis: broker/pipes.py, Gateway._read_direct, connection.subscriber), so an upgrade of redis-py that
changes one fails here instead of in a production call. redis is pinned to the range these cover."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import redis
import redis.client
import redis.connection


@pytest.fixture
def pipe(conn: redis.Redis) -> Any:
    return conn.pipeline(transaction=False)


def test_never_decode_and_empty_response_are_option_names() -> None:
    assert isinstance(redis.client.NEVER_DECODE, str) and isinstance(redis.client.EMPTY_RESPONSE, str)


def test_a_pipeline_queues_commands_on_command_stack_as_args_and_options(pipe: Any) -> None:
    pipe.get("k")
    assert pipe.command_stack == [(("GET", "k"), {})] or pipe.command_stack[0][0] == ("GET", "k")


def test_a_pipeline_keeps_its_scripts_in_a_set(conn: redis.Redis, pipe: Any) -> None:
    script = conn.register_script("return 1")
    script(keys=[], args=[], client=pipe)
    assert script in pipe.scripts and isinstance(pipe.scripts, set)


def test_a_pipeline_says_whether_it_watches_or_is_a_transaction(pipe: Any) -> None:
    assert pipe.watching is False and pipe.explicit_transaction is False and pipe.transaction is False


def test_a_pipeline_carries_its_pool_and_response_callbacks(pipe: Any) -> None:
    assert isinstance(pipe.connection_pool, redis.ConnectionPool)
    assert callable(pipe.response_callbacks.get("EXPIRE")) and len(pipe.response_callbacks) > 50


def test_a_connection_packs_sends_and_reads_without_decoding(conn: redis.Redis) -> None:
    c = conn.connection_pool.get_connection()
    try:
        c.send_packed_command([b"".join(c.pack_command("ECHO", "hi"))])
        assert c.read_response(disable_decoding=True) == b"hi"
    finally:
        conn.connection_pool.release(c)


def test_a_connection_retries_through_its_retry_policy(conn: redis.Redis) -> None:
    c = conn.connection_pool.get_connection()
    try:
        assert c.retry.call_with_retry(lambda: 7, lambda _e: None) == 7
        params = inspect.signature(c.retry.call_with_retry).parameters
        assert "is_retryable" in params
    finally:
        conn.connection_pool.release(c)


def test_read_response_takes_the_timeout_and_push_options_read_direct_passes() -> None:
    params = inspect.signature(redis.connection.Connection.read_response).parameters
    assert {"disable_decoding", "timeout", "disconnect_on_error", "push_request"} <= set(params)


def test_a_pubsub_exposes_its_connection_and_health_check_bookkeeping(conn: redis.Redis) -> None:
    ps = conn.pubsub()
    try:
        ps.subscribe("hermes:test:internals")
        assert ps.subscribed and ps.connection is not None
        assert isinstance(ps.health_check_response_counter, int)
        assert ps.is_health_check_response(b"redis-py-health-check") in (True, False)
    finally:
        ps.close()


def test_a_parser_class_takes_a_pubsub_push_handler() -> None:
    parser = redis.connection.DefaultParser
    assert hasattr(parser, "set_pubsub_push_handler")
    assert "push_handler_func" in inspect.signature(redis.client.PubSub.__init__).parameters


def test_a_cluster_pipeline_queues_args_and_options_on_its_execution_strategy() -> None:
    """pipes.stock reads a cluster pipeline's queued commands there, to resend those a moving slot refused."""
    from types import SimpleNamespace

    import redis.cluster

    assert "self._execution_strategy" in inspect.getsource(redis.cluster.ClusterPipeline.__init__)
    strategy = redis.cluster.PipelineStrategy(SimpleNamespace(nodes_manager=None, command_flags={}))  # type: ignore[arg-type]
    strategy.execute_command("EVALSHA", "f00", 1, "{q}k", "a")
    strategy.execute_command("SET", "k", "v", ex=5)
    assert [(c.args, c.options) for c in strategy.command_queue] == [
        (("EVALSHA", "f00", 1, "{q}k", "a"), {}),
        (("SET", "k", "v"), {"ex": 5}),
    ]


def test_an_asyncio_cluster_pipeline_queues_args_and_kwargs_on_its_execution_strategy() -> None:
    """pipes.resent reads an asyncio cluster pipeline's queued commands there, as pipes.stock a sync one's."""
    import redis.asyncio.cluster

    pipe: Any = redis.asyncio.cluster.ClusterPipeline(None)  # type: ignore[arg-type, abstract]
    pipe.execute_command("EVALSHA", "f00", 1, "{q}k", "a")
    pipe.execute_command("SET", "k", "v", ex=5)
    assert [(c.args, c.kwargs) for c in pipe._execution_strategy._command_queue] == [
        (("EVALSHA", "f00", 1, "{q}k", "a"), {}),
        (("SET", "k", "v"), {"ex": 5}),
    ]
