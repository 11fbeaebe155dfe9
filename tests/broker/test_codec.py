"""The msgpack codec: round trips, refuses what only pickle could carry, and never unpickles."""

from __future__ import annotations

import datetime as dt
import decimal
import pickle
from typing import Any

import msgpack
import pytest

from broker.codec import MsgpackSerializer, pack, unpack
from broker.errors import DecodeError

UNPICKLED: list[str] = []


def _record_unpickle(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Trap:
    """Unpickling this calls ``_record_unpickle``: a stand-in for arbitrary code execution."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_record_unpickle, ("executed",))


class Plain:
    def __init__(self) -> None:
        self.x = 1


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -1,
        2**63 - 1,
        -(2**63),
        1.5,
        "",
        "北京 ☃",
        b"\x00\xff bytes",
        [],
        {},
        [1, [2, [3, {"k": None}]]],
        {"a": {"b": [1.25, "x", b"y"]}, "n": None},
        {1: "int keys stay ints"},
    ],
)
def test_values_round_trip(value: Any) -> None:
    assert unpack(pack(value)) == value


def test_tuples_and_sets_travel_as_lists_and_datetimes_as_iso_strings() -> None:
    when = dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.UTC)
    assert unpack(pack({"t": (1, 2), "s": {3}, "f": frozenset({4}), "when": when, "day": when.date()})) == {
        "t": [1, 2],
        "s": [3],
        "f": [4],
        "when": "2024-05-06T07:08:09+00:00",
        "day": "2024-05-06",
    }


@pytest.mark.parametrize(
    "value",
    [
        object(),
        Plain(),
        Trap(),
        lambda: 1,
        len,
        complex(1, 2),
        decimal.Decimal("1.1"),
        type,
        [1, Plain()],
        {"k": {Plain()}},
    ],
    ids=[
        "object",
        "instance",
        "reducer",
        "lambda",
        "builtin",
        "complex",
        "decimal",
        "class",
        "nested",
        "in-set",
    ],
)
def test_types_only_pickle_could_carry_are_refused(value: Any) -> None:
    with pytest.raises(TypeError, match="cannot encode"):
        pack(value)
    with pytest.raises(TypeError):
        MsgpackSerializer.dumps(value)


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_pickles_are_never_unpickled(protocol: int) -> None:
    UNPICKLED.clear()
    data = pickle.dumps({"payload": Trap()}, protocol=protocol)
    for loads in (unpack, MsgpackSerializer.loads):
        try:
            value = loads(data)
        except DecodeError:
            continue
        # Whatever msgpack makes of pickle bytes, it is plain data, not the object the pickle describes.
        assert not isinstance(value, Trap)
    assert UNPICKLED == []


def test_msgpack_extension_types_stay_opaque() -> None:
    data = msgpack.packb(msgpack.ExtType(42, pickle.dumps(Trap())))
    UNPICKLED.clear()
    value = unpack(data)
    assert isinstance(value, msgpack.ExtType)
    assert UNPICKLED == []


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02", b"\xa5abc", pack([1]) + b"\x00"])
def test_malformed_bytes_are_a_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        unpack(data)
    with pytest.raises(DecodeError):
        MsgpackSerializer.loads(data)


def test_the_rq_serializer_is_msgpack() -> None:
    payload = ["workers.entry.run_call", None, [{"call_id": "c"}], {}]
    data = MsgpackSerializer.dumps(payload)
    assert msgpack.unpackb(data, raw=False) == payload
    assert MsgpackSerializer.loads(data) == payload


def test_a_refused_value_leaves_the_threads_packer_clean_and_threads_never_share_one() -> None:
    import threading

    with pytest.raises(TypeError):
        pack({"a": [1, 2, object()]})  # fails half way through the map
    assert unpack(pack({"b": 2})) == {"b": 2}  # nothing of the failed value is left in front

    errors: list[str] = []

    def many(n: int) -> None:
        for i in range(2000):
            value = {"t": n, "i": i, "s": "x" * (i % 50)}
            if unpack(pack(value)) != value:
                errors.append(f"{n}/{i}")

    threads = [threading.Thread(target=many, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_packing_a_large_value_leaves_no_large_buffer_behind() -> None:
    import gc
    import tracemalloc

    pack({"warm": 1})
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = pack({"blob": b"x" * (8 * 1024 * 1024)})
        assert len(out) > 8 * 1024 * 1024
        del out
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1024 * 1024, f"{held} bytes still held after packing one 8 MiB value"


def test_a_pack_nested_in_a_conversion_gets_its_own_packer() -> None:
    import datetime

    class Stamp(datetime.date):
        def isoformat(self) -> str:  # a conversion that packs something itself while the outer pack runs
            return pack({"inner": [1, 2, 3]}).hex()

    value = {"a": "before", "when": Stamp(2026, 12, 3), "z": "after"}
    got = unpack(pack(value))
    assert got == {"a": "before", "when": pack({"inner": [1, 2, 3]}).hex(), "z": "after"}
