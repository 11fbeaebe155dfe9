"""CallThreads: the threads a worker runs calls on."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tests.conftest import wait_until
from workers.worker import CallThreads, Tokens


def test_tasks_run_on_at_most_size_threads_and_idle_threads_are_reused() -> None:
    pool = CallThreads(3, "t")
    gate, started, names = threading.Event(), threading.Semaphore(0), set()
    lock = threading.Lock()

    def task(_: object) -> None:
        with lock:
            names.add(threading.current_thread().name)
        started.release()
        gate.wait(5)

    for i in range(5):
        pool.submit(task, i)
    for _ in range(3):
        assert started.acquire(timeout=5)
    assert not started.acquire(timeout=0.2)  # two wait: every thread is busy
    assert names == {"t_0", "t_1", "t_2"}
    gate.set()
    for _ in range(2):
        assert started.acquire(timeout=5)
    done = threading.Event()
    pool.submit(lambda _: done.set(), None)  # an idle thread takes it: no fourth thread
    assert done.wait(5) and len(pool._threads) == 3
    assert pool.shutdown() == 0


def test_a_failing_task_does_not_take_its_thread_with_it() -> None:
    pool = CallThreads(1, "t")
    pool.submit(lambda _: 1 / 0, None)
    ran = threading.Event()
    pool.submit(lambda _: ran.set(), None)
    assert ran.wait(5)
    pool.shutdown()


def test_shutdown_drops_what_has_not_started_and_refuses_more() -> None:
    pool = CallThreads(1, "t")
    gate, started, ran = threading.Event(), threading.Event(), []
    pool.submit(lambda _: (started.set(), gate.wait(5)), None)
    assert started.wait(5)  # the only thread is busy: what follows waits
    for i in range(3):
        pool.submit(ran.append, i)
    stopper = threading.Thread(target=lambda: setattr(stopper, "dropped", pool.shutdown()))
    stopper.start()
    wait_until(lambda: _inside(stopper, "join"), timeout=5, message="shutdown to drop the queue and wait for the busy thread")
    gate.set()
    stopper.join(5)
    assert stopper.dropped == 3 and ran == []  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError):
        pool.submit(ran.append, 9)


def test_tokens_hand_out_what_is_free_up_to_a_batch_and_wait_for_the_first() -> None:
    tokens = Tokens(5)
    assert tokens.take(3) == 3 and tokens.free == 2
    assert tokens.take(64) == 2 and tokens.free == 0
    t0 = time.monotonic()
    assert tokens.take(1, timeout=0.05) == 0  # none free: waits, then gives up
    assert time.monotonic() - t0 >= 0.04
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(tokens.take(10, timeout=5)))
    waiter.start()
    wait_until(lambda: _inside(waiter, "wait_for"), timeout=5, message="the waiter to wait for a token")
    tokens.give()
    tokens.give(2)
    waiter.join(5)
    assert got and 1 <= got[0] <= 3  # woken by the first token, takes what is free by then
    assert tokens.free == 3 - got[0]


def _inside(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is inside a call of ``function`` now (blocked there, say)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False
