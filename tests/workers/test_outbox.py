"""The write-behind outbox: one sender, pipelined, in order, every reply (or error) to its writer."""

from __future__ import annotations

import threading
import time
from typing import Any

import fakeredis
import pytest
import redis

from workers.outbox import Outbox


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def outbox(server: fakeredis.FakeServer) -> Any:
    box = Outbox(fakeredis.FakeRedis(server=server), max_batch=16)
    yield box
    box.close(5)


def test_writes_land_in_order_and_each_callback_gets_its_reply(outbox: Outbox, server: Any) -> None:
    replies: list[Any] = []
    for i in range(100):
        outbox.put(lambda pipe, i=i: pipe.rpush("l", i), replies.append)
    assert outbox.flush(5)
    r = fakeredis.FakeRedis(server=server)
    assert [int(x) for x in r.lrange("l", 0, -1)] == list(range(100))
    assert replies == list(range(1, 101))  # RPUSH answers the new length
    assert outbox._items.empty()


def test_each_threads_writes_keep_their_order(outbox: Outbox, server: Any) -> None:
    def writer(t: int) -> None:
        for i in range(200):
            outbox.put(lambda pipe, i=i: pipe.rpush(f"l{t}", i))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert outbox.flush(5)
    r = fakeredis.FakeRedis(server=server)
    for t in range(6):
        assert [int(x) for x in r.lrange(f"l{t}", 0, -1)] == list(range(200))


def test_a_failing_command_reports_to_its_own_callback_and_the_rest_still_land(
    outbox: Outbox, server: Any
) -> None:
    r = fakeredis.FakeRedis(server=server)
    r.set("str", "x")
    got: dict[str, Any] = {}
    outbox.put(lambda pipe: pipe.rpush("l", 1), lambda rep: got.setdefault("before", rep))
    outbox.put(lambda pipe: pipe.rpush("str", 1), lambda rep: got.setdefault("bad", rep))
    outbox.put(lambda pipe: pipe.rpush("l", 2), lambda rep: got.setdefault("after", rep))
    assert outbox.flush(5)
    assert got["before"] == 1 and got["after"] == 2
    assert isinstance(got["bad"], redis.ResponseError)
    with pytest.raises(redis.ResponseError):
        outbox.call(lambda pipe: pipe.rpush("str", 1), timeout=5)


def test_a_writer_that_cannot_be_built_fails_alone_and_what_it_added_is_not_sent(
    outbox: Outbox, server: Any
) -> None:
    """One call's write that raises while it is built (a value the wire cannot carry) must not take the
    other calls' writes of the batch down with it, nor send the half it had added."""
    from broker.codec import pack

    r = fakeredis.FakeRedis(server=server)
    got: dict[str, Any] = {}

    def broken(pipe: Any) -> None:
        pipe.rpush("half", 1)
        pipe.set("k", pack({"n": 2**70}))  # (raises: too big for msgpack)

    outbox.put(lambda pipe: pipe.rpush("l", 1), lambda rep: got.setdefault("before", rep))
    outbox.put(broken, lambda rep: got.setdefault("bad", rep))
    outbox.put(lambda pipe: pipe.rpush("l", 2), lambda rep: got.setdefault("after", rep))
    assert outbox.flush(5)
    assert got["before"] == 1 and got["after"] == 2
    assert isinstance(got["bad"], OverflowError | TypeError | ValueError)
    assert not r.exists("half") and not r.exists("k")


def test_a_writer_of_several_commands_gets_the_reply_of_its_first(outbox: Outbox, server: Any) -> None:
    def write(pipe: Any) -> None:
        pipe.rpush("multi", "a", "b")
        pipe.expire("multi", 60)
        pipe.llen("multi")

    assert outbox.call(write, timeout=5) == 2
    assert outbox.call(lambda pipe: pipe.rpush("multi", "c"), timeout=5) == 3  # later replies line up
    assert 0 < fakeredis.FakeRedis(server=server).ttl("multi") <= 60


def test_call_waits_for_the_reply(outbox: Outbox) -> None:
    assert outbox.call(lambda pipe: pipe.incrby("n", 5), timeout=5) == 5
    assert outbox.call(lambda pipe: pipe.get("n"), timeout=5) == b"5"


def test_a_crashing_callback_does_not_stop_the_sender(outbox: Outbox) -> None:
    def boom(_reply: Any) -> None:
        raise RuntimeError("callback bug")

    outbox.put(lambda pipe: pipe.incr("n"), boom)
    assert outbox.call(lambda pipe: pipe.incr("n"), timeout=5) == 2


def test_a_short_broker_outage_is_retried(outbox: Outbox, server: Any) -> None:
    server.connected = False
    done = threading.Event()
    box: list[Any] = []
    outbox.put(lambda pipe: pipe.rpush("l", "kept"), lambda rep: (box.append(rep), done.set()))
    threading.Event().wait(0.05)  # the first send fails; the sender backs off and tries again
    server.connected = True
    assert done.wait(5)
    assert box == [1]
    assert fakeredis.FakeRedis(server=server).lrange("l", 0, -1) == [b"kept"]


def test_a_long_broker_outage_keeps_the_writes_until_the_broker_is_back(outbox: Outbox, server: Any) -> None:
    # Past the first few tries (about 3 s) the writes were dropped, and a call that had finished during
    # the outage was run again once the broker came back.
    server.connected = False
    done = threading.Event()
    box: list[Any] = []
    outbox.put(lambda pipe: pipe.rpush("l", "result"), lambda rep: (box.append(rep), done.set()))
    assert not done.wait(4.5)  # still trying, nothing given up
    server.connected = True
    assert done.wait(5)
    assert box == [1] and fakeredis.FakeRedis(server=server).lrange("l", 0, -1) == [b"result"]


def test_a_closing_outbox_gives_up_on_an_unreachable_broker(server: Any) -> None:
    box = Outbox(fakeredis.FakeRedis(server=server), max_batch=16)
    server.connected = False
    got: list[Any] = []
    box.put(lambda pipe: pipe.rpush("l", "x"), got.append)
    started = time.monotonic()
    box.close(1)  # (the flush waits its second; the retry's backoff then ends at once)
    assert len(got) == 1 and isinstance(got[0], redis.ConnectionError)
    assert time.monotonic() - started < 2.5


def test_close_sends_what_is_queued(server: Any) -> None:
    box = Outbox(fakeredis.FakeRedis(server=server))
    for i in range(50):
        box.put(lambda pipe, i=i: pipe.rpush("l", i))
    box.close(5)
    assert fakeredis.FakeRedis(server=server).llen("l") == 50
    assert not box._thread.is_alive()


def test_a_script_the_server_lost_is_reloaded_and_its_commands_rerun_in_order(outbox: Outbox, server: Any) -> None:
    r = fakeredis.FakeRedis(server=server)
    push = r.register_script("return redis.call('RPUSH', KEYS[1], ARGV[1])")
    assert outbox.call(lambda pipe: push(keys=["l"], args=["a"], client=pipe), 5) == 1
    r.script_flush()  # a restarted or flushed server: the next pipeline skips the SCRIPT EXISTS check
    replies: list[Any] = []
    for v in ("b", "c"):
        outbox.put(lambda pipe, v=v: push(keys=["l"], args=[v], client=pipe), replies.append)
    assert outbox.flush(5)
    assert replies == [2, 3]
    assert r.lrange("l", 0, -1) == [b"a", b"b", b"c"]


def test_each_writer_gets_its_first_commands_reply_and_one_that_added_none_gets_none(outbox: Outbox) -> None:
    got: dict[str, Any] = {}
    outbox.put(lambda pipe: pipe.rpush("two", "a").rpush("two", "b"), lambda r: got.__setitem__("two", r))
    outbox.put(lambda pipe: None, lambda r: got.__setitem__("none", r))
    outbox.put(lambda pipe: pipe.incr("one"), lambda r: got.__setitem__("one", r))
    assert outbox.flush(5)
    assert got == {"two": 1, "none": None, "one": 1}


def test_while_a_moving_slot_holds_some_commands_the_writers_whose_commands_all_ran_are_answered() -> None:
    # (pipes.stock's on_settled after its first round on a cluster: commands 1 and 3 were refused)
    early: dict[int, Any] = {}
    settled = Outbox._settled([0, 2, 2, 3], [2, 2, 3, 5], early.__setitem__)
    settled(["a0", "MOVED", "c", "d", "MOVED"], {1, 4})
    assert early == {1: None, 2: "c"}  # the writer of 0-1 and the one of 3-4 wait for their resends
