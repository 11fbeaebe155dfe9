"""Idempotency keys in the SUBMIT and TRANSITION scripts: a key never names a vanished call, and a key
reused for another tool or other arguments is a conflict."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from broker import keys
from broker.calls import F_DIGEST, F_IDEM, CallInfo, Calls
from broker.envelope import Envelope, Options
from broker.errors import IdempotencyConflict
from broker.idempotency import request_digest
from broker.states import State
from tests.broker.test_calls import TP
from tests.broker.test_calls import env as calls_env

CKEY = "tool:echo"


def env(call_id: str, *, tool: str = "echo", idem: str | None = "k", **args: Any) -> Envelope:
    """test_calls' tool envelope, with an idempotency key by default."""
    return calls_env(call_id, tool=tool, idem=idem, **args)


def llm(call_id: str, content: str, model: str = "m1", idem: str = "k") -> Envelope:
    return Envelope(
        call_id=call_id,
        kind="llm",
        request={"model": model, "messages": [{"role": "user", "content": content}]},
        traceparent=TP,
        queue="llm",
        channel="hermes:ch:test",
        options=Options(idempotency_key=idem),
    )


def submit(calls: Calls, e: Envelope) -> tuple[bool, str]:
    reply = calls.submit(e, ckey=CKEY, queue_size=-1, max_attempts=3, timeout=5)
    return Calls.check_submit(reply, CKEY, -1, e)


def finish(calls: Calls, e: Envelope, ttl: int) -> None:
    reply = calls.transition(CallInfo.of(e, CKEY), State.CANCELLED, attempt=1, fence=False, ttl=ttl)
    assert int(reply[0]) > 0


def test_the_same_request_under_a_key_returns_the_existing_call_with_its_name(fake: Any) -> None:
    calls = Calls(fake)
    assert submit(calls, env("first", n=1, when=[1, 2])) == (True, "first")
    reply = calls.submit(env("second", when=[1, 2], n=1), ckey=CKEY, queue_size=-1, max_attempts=3, timeout=5)
    assert Calls.check_submit(reply, CKEY, -1, env("second", n=1, when=[1, 2])) == (False, "first")
    assert Calls.existing_call(reply) == ("echo", "tool")
    assert not fake.exists(keys.job("second"))
    assert fake.get(keys.idempotency("{tools}", "k")) == b"first"
    rec = fake.hmget(keys.job("first"), F_IDEM, F_DIGEST)
    assert rec == [keys.idempotency("{tools}", "k").encode(), request_digest(env("x", n=1, when=[1, 2])).encode()]


def test_other_arguments_under_a_key_are_a_conflict(fake: Any) -> None:
    calls = Calls(fake)
    submit(calls, env("first", amount=10))
    with pytest.raises(IdempotencyConflict) as info:
        submit(calls, env("second", amount=99999))
    err = info.value
    assert err.type == "idempotency_conflict"
    assert err.details == {"key": "k", "call_id": "first", "tool": "echo", "kind": "tool"}
    assert str(err) == (
        "idempotency key 'k' already belongs to call first of tool 'echo' with different arguments: reuse a key "
        "only to resubmit the same call"
    )
    assert not fake.exists(keys.job("second"))
    assert fake.llen(keys.queue("tools")) == 1


def test_another_tool_under_a_key_is_a_conflict_naming_both_tools(fake: Any) -> None:
    calls = Calls(fake)
    submit(calls, env("first", amount=10))
    with pytest.raises(IdempotencyConflict) as info:
        submit(calls, env("second", tool="hget", amount=10))
    assert str(info.value) == "idempotency key 'k' already belongs to call first of tool 'echo': it cannot be reused for tool 'hget'"
    assert info.value.details["call_id"] == "first" and info.value.details["tool"] == "echo"


def test_llm_requests_conflict_on_another_request_or_model_and_not_with_a_tool_call(fake: Any) -> None:
    calls = Calls(fake)
    assert submit(calls, llm("first", "hi")) == (True, "first")
    assert submit(calls, llm("again", "hi")) == (False, "first")
    with pytest.raises(IdempotencyConflict, match="call first of model 'm1' with a different request"):
        submit(calls, llm("second", "bye"))
    with pytest.raises(IdempotencyConflict, match="it cannot be reused for model 'm2'"):
        submit(calls, llm("third", "hi", model="m2"))
    # Idempotency keys are per queue (they live in the queue's hash slot): on the tools queue the same
    # key names no LLM call.
    assert submit(calls, env("fourth")) == (True, "fourth")


def test_a_key_whose_call_record_is_gone_runs_a_new_call(fake: Any) -> None:
    # As an older version left it: the key (plain call id, 7 days) outlived the record and its history.
    calls = Calls(fake)
    fake.set(keys.idempotency("{tools}", "k"), "vanished", ex=7 * 86400)
    assert submit(calls, env("new", v=2)) == (True, "new")
    assert fake.get(keys.idempotency("{tools}", "k")) == b"new"
    assert fake.lrange(keys.queue("tools"), 0, -1) == [b"new"]
    # and the same with a record of ours that expired
    submit(calls, env("a", idem="k2", v=1))
    fake.delete(keys.job("a"), keys.history("a"), keys.ended("a"))
    assert submit(calls, env("b", idem="k2", v=99)) == (True, "b")


def test_a_record_of_an_older_version_has_no_digest_its_tool_is_still_compared(fake: Any) -> None:
    calls = Calls(fake)
    submit(calls, env("old", v=1))
    fake.hdel(keys.job("old"), F_DIGEST, F_IDEM)  # as an older version wrote it
    assert submit(calls, env("same-tool", v=2)) == (False, "old")  # nothing to compare the args with
    with pytest.raises(IdempotencyConflict, match="cannot be reused for tool 'nap'"):
        submit(calls, env("other-tool", tool="nap", v=1))


def test_ending_a_call_gives_its_key_the_records_ttl(fake: Any) -> None:
    calls = Calls(fake)
    e = env("first", v=1)
    submit(calls, e)
    idem = keys.idempotency("{tools}", "k")
    assert fake.ttl(idem) > 86400  # pending: as long as the pending record
    finish(calls, e, ttl=3)
    assert 0 < fake.ttl(idem) <= 3
    assert fake.ttl(keys.job("first")) == fake.ttl(idem) == fake.ttl(keys.ended("first"))


def test_ending_a_call_leaves_a_key_that_names_another_call_alone(fake: Any) -> None:
    calls = Calls(fake)
    e = env("first", v=1)
    submit(calls, e)
    idem = keys.idempotency("{tools}", "k")
    fake.set(idem, "someone-else", ex=1000)
    finish(calls, e, ttl=3)
    assert fake.get(idem) == b"someone-else" and fake.ttl(idem) > 900


def test_calls_without_a_key_carry_no_idempotency_fields(fake: Any) -> None:
    calls = Calls(fake)
    e = env("plain", idem=None, v=1)
    assert submit(calls, e) == (True, "plain")
    assert fake.hmget(keys.job("plain"), F_IDEM, F_DIGEST) == [None, None]
    finish(calls, e, ttl=3)
    assert fake.keys(keys.idempotency("{tools}", "*")) == []


def test_the_digest_is_canonical_and_tells_requests_apart() -> None:
    a = request_digest(env("a", x=1, y={"p": [1, 2], "q": None}))
    assert a == request_digest(env("b", y={"q": None, "p": [1, 2]}, x=1))  # key order does not matter
    assert a != request_digest(env("c", x=1, y={"p": [2, 1], "q": None}))  # list order does
    assert a != request_digest(env("d", tool="other", x=1, y={"p": [1, 2], "q": None}))
    assert request_digest(env("e", s={"b", "a"})) == request_digest(env("f", s={"a", "b"}))
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    assert request_digest(env("g", t=when)) == request_digest(env("h", t=when.isoformat()))  # as on the wire
    assert request_digest(llm("i", "hi")) != request_digest(llm("j", "hi", model="m2"))
    with pytest.raises(TypeError, match="cannot encode object"):
        request_digest(env("k", o=object()))


def test_a_key_and_its_digest_are_the_principals_own_so_a_key_is_not_shared_across_principals(fake: Any) -> None:
    def as_(call_id: str, principal: str | None, **context: Any) -> Envelope:
        e = env(call_id, x=1)
        e.context.update(context, **({"principal": principal} if principal else {}))
        return e

    # Without a principal the digest is what it always was (keys stored before principals still match).
    assert request_digest(as_("a", None)) == request_digest(env("b", x=1))
    assert request_digest(as_("c", "admin")) != request_digest(as_("d", "alice"))
    assert request_digest(as_("e", "alice", session_id="s1")) == request_digest(as_("f", "alice", session_id="s2"))

    calls = Calls(fake)
    assert submit(calls, as_("admins", "admin")) == (True, "admins")
    assert submit(calls, as_("alices", "alice")) == (True, "alices")  # her own key: neither blocked nor admin's
    assert submit(calls, as_("again", "admin")) == (False, "admins")
    assert submit(calls, as_("anon", None)) == (True, "anon")
    assert fake.get(keys.idempotency("{tools}", "k\0alice")) == b"alices"
    assert fake.get(keys.idempotency("{tools}", "k")) == b"anon"
