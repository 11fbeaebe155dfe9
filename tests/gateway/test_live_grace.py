"""A follower whose quiet resync finds the call already ended takes the live events still unread in its
subscription first: an ended call keeps its end alone, so a stream's deltas exist nowhere else."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import redis

from broker import events, keys
from broker.codec import pack, unpack

CID = "{tools}.feedfacefeedfacefeedfacefeedface"


def event(seq: int, state: str, type_: str = events.TRANSITION, detail: dict[str, Any] | None = None) -> bytes:
    body = events.payload(
        call_id=CID, state=state, trace_id="a" * 32, span_id="b" * 16, attempt=1, kind="llm", name="m",
        session_id=None, type=type_, detail=detail,
    )  # fmt: skip
    return pack({**unpack(body), "seq": seq})


LIVE = [
    event(1, "pending"),
    event(2, "executing"),
    event(3, "executing", events.DELTA, {"content": "hello "}),
    event(4, "executing", events.DELTA, {"content": "world"}),
]
END = event(5, "done", detail={"result": {"content": "hello world"}})


def deltas(handle: Any) -> list[str]:
    return [e.detail["content"] for e in handle._events if e.type == events.DELTA]


def test_a_threaded_follower_takes_the_unread_live_events_before_the_kept_end(gateway: Any, conn: redis.Redis) -> None:
    from hermes_gateway.handle import CallHandle

    conn.set(keys.ended(CID), END)  # the call ended: its history is the end alone
    handle = gateway.router.track(CallHandle(gateway, CID, "m", "llm"))
    # The event thread routes the live events a moment after the resync read the history.
    late = threading.Timer(0.05, lambda: [handle.feed(events.decode(e)) for e in [*LIVE, END]])
    late.start()
    handle.sync(live_grace=2.0)
    late.join()
    assert [e.seq for e in handle._events] == [1, 2, 3, 4, 5] and handle.final_state == "done"
    assert deltas(handle) == ["hello ", "world"]


def test_an_async_follower_takes_the_unread_live_events_before_the_kept_end(redis_url: str, home: Any, conn: redis.Redis) -> None:
    from hermes_gateway.aio import AsyncGateway
    from hermes_gateway.aio_handle import AsyncCallHandle

    conn.set(keys.ended(CID), END)

    async def scenario() -> AsyncCallHandle:
        gw = await AsyncGateway.connect(redis_url, home=str(home.path), embedded_ok=False, check_workers=False)
        try:
            handle = gw.router.track(AsyncCallHandle(gw, CID, "m", "llm"))

            async def live() -> None:
                await asyncio.sleep(0.05)
                for e in [*LIVE, END]:
                    handle.feed(events.decode(e))

            feeder = asyncio.create_task(live())
            await handle.sync(live_grace=2.0)
            await feeder
            return handle
        finally:
            await gw.close()

    handle = asyncio.run(scenario())
    assert [e.seq for e in handle._events] == [1, 2, 3, 4, 5] and handle.final_state == "done"
    assert deltas(handle) == ["hello ", "world"]


def test_a_follower_whose_call_has_not_ended_does_not_wait(gateway: Any, conn: redis.Redis) -> None:
    """No kept end: the history is read and taken at once (the grace is for an ended call only)."""
    import time

    from hermes_gateway.handle import CallHandle

    conn.rpush(keys.history(CID), *LIVE[:2])
    handle = gateway.router.track(CallHandle(gateway, CID, "m", "llm"))
    started = time.monotonic()
    handle.sync(live_grace=2.0)
    assert time.monotonic() - started < 1.0 and [e.seq for e in handle._events] == [1, 2]


def test_result_then_events_lists_the_live_events_its_quiet_resync_found_unread(
    gateway: Any, conn: redis.Redis, monkeypatch: Any
) -> None:
    """result() re-reads the history after a quiet second too: finding the kept end past events it has not
    seen, it gives the live feed its grace first, so a later events() still lists them (a gRPC stream's
    progress was lost so, once, in a loaded full run)."""
    import hermes_gateway.handle as handle_mod
    from hermes_gateway.handle import CallHandle
    from tests.conftest import wait_until

    monkeypatch.setattr(handle_mod, "LIVE_GRACE", 10.0)  # (it ends when the live end arrives)
    conn.set(keys.ended(CID), END)
    handle = gateway.router.track(CallHandle(gateway, CID, "m", "llm"))

    def live() -> None:  # the event thread, once the resync waits for it
        wait_until(lambda: handle._followers > 0, timeout=5, message="the resync to wait for the live feed")
        for e in [*LIVE, END]:
            handle.feed(events.decode(e))

    feeder = threading.Thread(target=live)
    feeder.start()
    assert handle.result(timeout=8) == {"content": "hello world"}
    feeder.join(5)
    assert [e.seq for e in handle._events] == [1, 2, 3, 4, 5]
    assert deltas(handle) == ["hello ", "world"]
