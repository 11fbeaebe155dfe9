"""What a call asked for (``views.call_request``): from its envelope while it runs, from its audit record
once it has ended (an ended call keeps no envelope), or a clear word that it is gone."""

from __future__ import annotations

from typing import Any

from broker.audit import AuditLog, AuditRecord
from broker.calls import CallInfo, Calls
from broker.directory import Directory
from broker.envelope import Envelope
from broker.states import State
from hermes_gateway.views import call_request
from workers.specs import check_spec

SPEC = {"name": "login", "executor": "python", "function": "workers.executors.builtin:echo", "sensitive": ["ssn"]}
ARGS = {"user": "ann", "ssn": "123-45-6789"}


def _submit(fake: Any) -> CallInfo:
    version, _ = Directory(fake).register(check_spec(SPEC))
    env = Envelope(
        call_id="{tools}.c1", kind="tool", tool="login", args=ARGS, channel="hermes:ch:t", tool_version=version,
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        context={"session_id": "s1"},
    )
    Calls(fake).submit(env, ckey="tool:login", queue_size=-1, max_attempts=1, timeout=5)
    return CallInfo.of(env, "tool:login")


def test_a_running_calls_request_hashes_the_sensitive_args_and_all_once_its_tool_is_gone(fake: Any) -> None:
    _submit(fake)
    asked = call_request(fake, "{tools}.c1")
    assert asked is not None and asked["args"]["user"] == "ann" and asked["args"]["ssn"] == "***"
    assert asked["context"] == {"session_id": "s1"} and "source" not in asked
    Directory(fake).remove("login")  # its spec can no longer say which args were sensitive
    after = call_request(fake, "{tools}.c1")
    assert after is not None and all(v == "***" for v in after["args"].values())


def test_an_ended_calls_request_comes_from_its_audit_record_or_is_said_to_be_gone(fake: Any) -> None:
    info = _submit(fake)
    Calls(fake).transition(info, State.CANCELLED, attempt=1, fence=False)
    assert call_request(fake, "{tools}.c1", AuditLog(fake)) == {
        "call_id": "{tools}.c1",
        "kind": "tool",
        "name": "login",
        "state": "cancelled",
        "error": "the call has ended: its request is no longer kept (an ended call keeps only its outcome), "
        "and no audit record of it was found",
    }
    AuditLog(fake).append(
        AuditRecord.of(
            call_id="{tools}.c1", kind="tool", state="cancelled", args=ARGS, sensitive=("ssn",),
            tool_name="login", session_id="s1", digest=AuditLog(fake).digest,
        )
    )
    asked = call_request(fake, "{tools}.c1", AuditLog(fake))
    assert asked is not None and asked["source"] == "audit" and "no longer kept" in asked["note"]
    assert asked["args"]["user"] == "ann" and asked["args"]["ssn"].startswith("hmac-sha256:")
    assert asked["context"] == {"session_id": "s1"}
