"""The call envelope: msgpack round trip, and every malformed payload is a DecodeError."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from broker.calls import envelope_of
from broker.codec import pack
from broker.envelope import ENVELOPE_VERSION, Envelope, Options
from broker.errors import DecodeError

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def tool_env(**kw: Any) -> Envelope:
    base: dict[str, Any] = {
        "call_id": "c1",
        "kind": "tool",
        "traceparent": TP,
        "tool": "get_weather",
        "args": {"city": "北京", "days": 3, "nested": {"a": [1, 2.5, None, True]}},
        "tool_version": 4,
        "context": {"session_id": "s1", "tool_call_id": "tc9"},
        "tracestate": "vendor=1",
        "options": Options(timeout=2.5, idempotency_key="k1", max_attempts=2),
        "queue": "tools",
        "channel": "hermes:ch:abc",
        "submitted_at": 1_700_000_000.5,
    }
    base.update(kw)
    return Envelope(**base)


def valid_dict(**changes: Any) -> dict[str, Any]:
    d = tool_env().to_dict()
    d.update(changes)
    return d


def test_tool_envelope_round_trips_through_msgpack() -> None:
    env = tool_env()
    data = env.encode()
    assert isinstance(data, bytes)
    assert Envelope.decode(data) == env


def test_llm_envelope_round_trips_and_is_named_by_its_model() -> None:
    env = Envelope(
        call_id="c2",
        kind="llm",
        traceparent=TP,
        request={"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]},
        context={"provider": "openai"},
    )
    back = Envelope.decode(env.encode())
    assert back == env
    assert back.name == "gpt-x"
    assert back.tool is None


def test_trace_ids_come_from_the_traceparent() -> None:
    env = tool_env()
    assert env.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert env.parent_span_id == "00f067aa0ba902b7"
    assert tool_env(traceparent="garbage").trace_id == ""


def test_unknown_fields_from_a_newer_client_are_ignored() -> None:
    assert Envelope.from_dict(valid_dict(future_field={"x": 1})) == tool_env()


def test_unknown_option_fields_are_ignored() -> None:
    d = valid_dict()
    d["options"] = {**d["options"], "priority": "high"}
    assert Envelope.from_dict(d).options == Options(timeout=2.5, idempotency_key="k1", max_attempts=2)


BAD_BYTES = [
    b"",  # nothing
    b"\xc1",  # the one byte msgpack never uses
    b"\x92\x01",  # array of 2 with one element: truncated
    b"\xd9\x05ab",  # str8 of length 5 with two bytes
    pack({"a": 1}) + b"\x01",  # trailing data
    b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00",  # the start of a pickle
    b"{}",  # JSON, not msgpack
]


@pytest.mark.parametrize("data", BAD_BYTES, ids=range(len(BAD_BYTES)))
def test_bytes_that_are_not_msgpack_are_a_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        Envelope.decode(data)


BAD_SHAPES: list[Any] = [
    None,
    1,
    "envelope",
    [1, 2, 3],
    b"raw",
    {},
    valid_dict(version=None),
    valid_dict(version=ENVELOPE_VERSION + 1),
    valid_dict(version="1"),
    valid_dict(call_id=None),
    valid_dict(call_id=""),
    valid_dict(call_id=7),
    valid_dict(kind="shell"),
    valid_dict(kind=None),
    valid_dict(traceparent=None),
    valid_dict(traceparent=b"00-ab"),
    valid_dict(tool=None),
    valid_dict(tool=""),
    valid_dict(args=[1, 2]),
    valid_dict(args="city=x"),
    valid_dict(context=["s1"]),
    valid_dict(options=[1]),
    valid_dict(options="fast"),
    valid_dict(kind="llm", request=None),
    valid_dict(kind="llm", request=["gpt"]),
    {k: v for k, v in valid_dict().items() if k != "kind"},
    {k: v for k, v in valid_dict().items() if k != "version"},
]


@pytest.mark.parametrize("data", BAD_SHAPES, ids=range(len(BAD_SHAPES)))
def test_msgpack_of_the_wrong_shape_is_a_decode_error(data: Any) -> None:
    with pytest.raises(DecodeError):
        Envelope.from_dict(data)
    with pytest.raises(DecodeError):
        Envelope.decode(msgpack.packb(data, use_bin_type=True))


BAD_TYPES: list[dict[str, Any]] = [
    valid_dict(tool=5),
    valid_dict(tool_version="latest"),
    valid_dict(tool_version=None),
    valid_dict(queue=None),
    valid_dict(queue=["tools"]),
    valid_dict(channel=3),
    valid_dict(tracestate=1),
    valid_dict(submitted_at="yesterday"),
    valid_dict(options={"timeout": "soon"}),
    valid_dict(options={"max_attempts": "3"}),
    valid_dict(options={"idempotency_key": 12}),
]


@pytest.mark.parametrize("data", BAD_TYPES, ids=range(len(BAD_TYPES)))
def test_fields_of_the_wrong_type_are_a_decode_error(data: dict[str, Any]) -> None:
    # A worker must learn at decode time that a payload is malformed, not crash on it later.
    with pytest.raises(DecodeError):
        Envelope.from_dict(data)


def test_random_bytes_never_raise_anything_but_decode_error() -> None:
    rng = random.Random(1234)
    good = tool_env().encode()
    for i in range(3000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:  # flip bytes of a valid envelope: mostly well-formed msgpack with broken values
            buf = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            data = bytes(buf)
        try:
            env = Envelope.decode(data)
        except DecodeError:
            continue
        assert isinstance(env, Envelope)


def test_job_data_of_another_shape_is_a_decode_error() -> None:
    good = pack(["workers.entry.run_call", None, [tool_env().to_dict()], {}])
    assert envelope_of(good) == tool_env()
    for bad in (
        b"\xc1",
        pack({"func": "x"}),
        pack(["workers.entry.run_call", None, [], {}]),
        pack(["workers.entry.run_call", None, "env", {}]),
        pack(["workers.entry.run_call", None, [tool_env().to_dict()]]),
        pack(["workers.entry.run_call", None, [["not", "a", "mapping"]], {}]),
    ):
        with pytest.raises(DecodeError):
            envelope_of(bad)


def test_a_decoded_envelope_missing_optional_fields_gets_the_same_defaults_as_the_constructor() -> None:
    minimal = {"version": 1, "call_id": "c1", "kind": "tool", "tool": "echo", "traceparent": TP}
    first, second = Envelope.from_dict(dict(minimal)), Envelope.from_dict(dict(minimal))
    built = Envelope(call_id="c1", kind="tool", tool="echo", traceparent=TP, submitted_at=first.submitted_at)
    assert first == built and repr(first) == repr(built)
    assert first.context == {} and first.context is not second.context  # a fresh dict each, as the factory makes
    assert first.options == Options() and first.queue == "tools" and first.args is None
    with pytest.raises(DecodeError):
        Envelope.from_dict({**minimal, "kind": "shell"})  # __post_init__'s checks still run


@pytest.mark.parametrize("entries", [0, 1, 14, 15, 16, 70_000])
def test_extend_map_adds_one_entry_across_the_fixmap_map16_and_map32_headers(entries: int) -> None:
    from broker.codec import extend_map, unpack

    base = {f"k{i}": i for i in range(entries)}
    spliced = extend_map(pack(base), "body") + pack({"x": [1, "二"]})
    assert unpack(spliced) == {**base, "body": {"x": [1, "二"]}}


def test_extend_map_refuses_what_is_not_a_packed_map() -> None:
    from broker.codec import extend_map

    with pytest.raises(ValueError, match="not a packed map"):
        extend_map(pack([1, 2]), "body")


def test_job_data_puts_the_checked_bytes_in_as_they_are_and_decodes_like_a_fresh_pack() -> None:
    env = tool_env(args={"city": "x"})
    fresh = env.job_data("workers.entry.run_call")
    # The same mapping in a longer (valid, non-canonical) form: a map 16 header where a pack gives a fixmap.
    packed_args = b"\xde\x00\x01" + pack("city") + pack("x")
    assert packed_args not in fresh
    kept = tool_env(args={"city": "x"}).keep_packed(packed_args).job_data("workers.entry.run_call")
    assert packed_args in kept  # not packed again: the very bytes the client checked
    assert msgpack.unpackb(kept, raw=False) == msgpack.unpackb(fresh, raw=False)
    assert envelope_of(kept) == env
    llm = Envelope(call_id="c2", kind="llm", traceparent=TP, request={"model": "m", "messages": []})
    assert envelope_of(llm.keep_packed(pack(llm.request)).job_data("f")) == llm


def test_fairness_key_defaults_to_principal_then_session_and_class_to_interactive():
    from broker.envelope import Envelope, Options, fairness_of

    base = {"call_id": "{tools}.ab", "kind": "tool", "tool": "t", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    assert fairness_of(Envelope(**base, context={"principal": "alice", "session_id": "s1"})) == ("alice", "interactive")
    assert fairness_of(Envelope(**base, context={"session_id": "s1"})) == ("s1", "interactive")
    assert fairness_of(Envelope(**base)) == ("", "interactive")
    env = Envelope(**base, context={"principal": "alice"}, options=Options(fairness_key="batch:b1", call_class="batch"))
    assert fairness_of(env) == ("batch:b1", "batch")
    assert fairness_of(Envelope.decode(env.encode())) == ("batch:b1", "batch")


def test_a_bad_fairness_key_or_class_is_a_typed_error():
    import pytest

    from broker.errors import InvalidArgs
    from hermes_gateway.clientcore import CallOptions

    with pytest.raises(InvalidArgs, match="call_class must be one of interactive, batch"):
        CallOptions(call_class="urgent").envelope_options()
    with pytest.raises(InvalidArgs, match="fairness_key must be a non-empty string"):
        CallOptions(fairness_key="").envelope_options()
    with pytest.raises(InvalidArgs, match="fairness_key"):
        CallOptions(fairness_key="x" * 300).envelope_options()
    assert CallOptions(fairness_key="k", call_class="batch").envelope_options().call_class == "batch"
