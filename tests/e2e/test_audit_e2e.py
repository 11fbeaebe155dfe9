"""The audit log on real workers: one record per call through a worker SIGKILL, and no secret in any
record, in the JSONL mirror, in an export, or in the worker's own log output."""

from __future__ import annotations

import collections
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from broker import events, keys
from broker.audit import AuditLog, AuditRecord
from broker.errors import CallFailed
from broker.logs import hash_value
from middleware import enable_plugin
from tests.broker.test_redact import CORPUS
from tests.conftest import ECHO, Home, wait_until
from tests.e2e.util import all_terminal, current, field

pytestmark = pytest.mark.e2e

LEASE = 2.0


def all_records(conn: Any) -> list[AuditRecord]:
    return [AuditRecord.decode(entry[b"d"]) for _, entry in conn.xrange(keys.AUDIT_STREAM)]


def test_every_one_of_a_thousand_calls_has_one_audit_record_through_a_worker_kill(
    home: Home, gateway: Any, workers: Any, conn: Any, tmp_path: Path
) -> None:
    mirror = tmp_path / "audit.jsonl"
    home.config({"audit": {"jsonl": str(mirror)}, "policy": {"principals": {"batch": {"grants": ["batch"]}}}})
    wide = {"concurrency": 64}  # cluster-wide slots per tool; the default (5) would serialise the batch
    home.noop_tool("noop", permissions=["batch"], **wide)
    home.noop_tool("locked", permissions=["admin"], **wide)
    home.tool(
        "strict_echo", function=ECHO, timeout=10, input_schema={"type": "object", "required": ["x"]}, **wide
    )
    home.sleep_tool(**wide)
    gateway.sync_tools()
    a, b = workers(2, concurrency=16, lease=LEASE)

    # Sleepers first, so both workers hold calls in flight when one is killed; half may be retried. (3 s:
    # on a loaded machine a shorter sleeper seen running may have ended by the time the kill lands.)
    sleepers = [gateway.call_tool("sleep", {"seconds": 3.0}, max_attempts=1 + 2 * (i % 2)) for i in range(24)]
    once, retried = sleepers[0::2], sleepers[1::2]
    kinds = ["noop"] * 8 + ["locked", "strict_echo"]
    rest = gateway.submit_many([(kinds[i % 10], {}) for i in range(976)], principal="batch")
    handles = [*sleepers, *rest]
    ids = [h.call_id for h in handles]
    assert len(set(ids)) == 1000

    groups = ({h.call_id for h in once}, {h.call_id for h in retried})

    def holding_both() -> Any:
        running = [c for c, s in current(conn, [*groups[0], *groups[1]]).items() if s == "executing"]
        for w in (a, b):
            mine = {c for c in running if field(conn, c, keys.F_WORKER) == w.name}
            if mine & groups[0] and mine & groups[1]:
                return w
        return None

    victim = wait_until(holding_both, 10, message="a worker running sleepers of both kinds")
    survivor = b if victim is a else a
    victim.kill()
    wait_until(lambda: all_terminal(conn, ids), 60, message="all 1,000 calls terminal")
    assert survivor.alive

    final = current(conn, ids)
    by_call = collections.defaultdict(list)
    for rec in all_records(conn):
        by_call[rec.call_id].append(rec)
    assert set(by_call) == set(ids)
    assert [c for c, recs in by_call.items() if len(recs) != 1] == []
    assert all(by_call[c][0].state == final[c] for c in ids)
    errors = collections.Counter(by_call[c][0].error_type for c in ids)
    assert errors["permission_denied"] == 97 and errors["invalid_args"] == 97
    assert errors["worker_lost"] >= 1, errors  # a one-attempt sleeper of the victim, audited by the reaper
    assert errors[None] == 1000 - sum(n for t, n in errors.items() if t is not None)
    assert {by_call[c][0].principal for c in ids[24:]} == {"batch"}
    assert {by_call[h.call_id][0].attempts for h in retried if by_call[h.call_id][0].state == "done"} >= {2}

    # The JSONL mirror names every call (a killed worker may have mirrored a line it never committed).
    mirrored = {json.loads(line)["call_id"] for line in mirror.read_text().splitlines()}
    assert mirrored == set(ids)


LEAKY = "audit-e2e-leaky"
# A plugin that leaks: its tool_request middleware fails with the args in the message (the worker logs
# middleware failures, traceback and all), and it logs the args through stdlib logging.
LEAKY_CODE = """
import logging

log = logging.getLogger(__name__)

def register(ctx):
    ctx.register_middleware("tool_request", leak)

def leak(**kw):
    log.warning("leaky plugin saw args %s", kw["args"])
    raise RuntimeError(f"leaky plugin cannot rewrite {kw['args']!r}")
"""


def test_secrets_reach_no_audit_record_mirror_export_or_worker_log(
    home: Home, gateway: Any, workers: Any, conn: Any, tmp_path: Path, redis_url: str
) -> None:
    from tests.e2e.test_policy_e2e import cli

    mirror = tmp_path / "audit.jsonl"
    home.config({"audit": {"jsonl": str(mirror)}})
    home.tool("login", function=ECHO, timeout=10, sensitive=["password"])
    home.tool("explode", function="tests.workers.executors.pyfuncs:explode", timeout=10)
    folder = home.path / "plugins" / LEAKY
    folder.mkdir()
    (folder / "plugin.yaml").write_text(f"name: {LEAKY}\nversion: '0.1'\nkind: standalone\n")
    (folder / "__init__.py").write_text(textwrap.dedent(LEAKY_CODE))
    enable_plugin(home.path, LEAKY)
    gateway.sync_tools()
    [worker] = workers(1)

    passwords = [f"pw-{i}-Zq8vK2mN" for i in range(len(CORPUS))]
    done = gateway.submit_many(
        [
            ("login", {"note": text, "password": pw})
            for (_, text, _), pw in zip(CORPUS, passwords, strict=True)
        ]
    )
    failed = gateway.submit_many([("explode", {"message": text}) for _, text, _ in CORPUS])
    for h, (_, text, _), pw in zip(done, CORPUS, passwords, strict=True):
        assert h.result(20) == {"note": text, "password": pw}  # the caller gets its own data back
    for h in failed:
        with pytest.raises(CallFailed) as info:
            h.result(20)
        assert info.value.type == "executor_error"

    audit = AuditLog(conn)
    for h, pw in zip(done, passwords, strict=True):
        rec = audit.get(h.call_id)
        assert rec is not None and rec.state == "done"
        # replayable (keyed: hashing every candidate password, or PIN, finds none)
        assert rec.args["password"] == rec.sensitive_hashes["password"] == audit.digest(pw) != hash_value(pw)
    wait_until(lambda: len(all_records(conn)) == 2 * len(CORPUS), 5)
    wait_until(lambda: worker.log().count("leaky plugin cannot rewrite") >= 2 * len(CORPUS), 10)

    records = "\n".join(r.to_json() for r in all_records(conn)) + "\n".join(
        repr(r.to_dict()) for r in all_records(conn)
    )
    exported = cli(redis_url, home, "audit", "export")
    logged = worker.log()
    assert logged.count("leaky plugin saw args") >= 2 * len(CORPUS)  # the plugin did try to log them
    assert "Traceback" in logged and "RuntimeError" in logged
    places = {"records": records, "mirror": mirror.read_text(), "export": exported, "worker log": logged}
    assert all(len(text) > 1000 for text in places.values())
    for where, text in places.items():
        leaked = [shape for shape, _, secret in CORPUS if secret in text]
        leaked += [pw for pw in passwords if pw in text]
        assert leaked == [], f"secrets in the {where}: {leaked}"


def test_a_back_ends_error_quoting_a_secret_argument_shows_it_nowhere(
    home: Home, gateway: Any, workers: Any, conn: Any
) -> None:
    """`ls {{password}}` fails with `ls: cannot access 'hunter2…'`: the value of a sensitive (or
    secret-named) argument is masked in the error the caller, the event, the audit record, the worker's
    log line and the fleet's recent failures carry."""
    home.tool("lsp", executor="command", command="ls {{password}}", timeout=10, sensitive=["password"],
              input_schema={"type": "object", "properties": {"password": {"type": "string"}}})  # fmt: skip
    home.tool("lsk", executor="command", command="ls {{api_token}}", timeout=10,
              input_schema={"type": "object", "properties": {"api_token": {"type": "string"}}})  # fmt: skip
    # A secret inside an object or a list is quoted whole by a schema check: "{'x': '...'} is not of type".
    home.tool("typed", executor="command", command="true", timeout=10, sensitive=["password"],
              input_schema={"type": "object", "properties": {"password": {"type": "integer"}}})  # fmt: skip
    gateway.sync_tools()
    [worker] = workers(1)
    secret, token, nested, listed = "hunter2-PWLEAK-B", "tok-LEAK-77aa", "hunter3-NESTED-C", "hunter4-LISTED-D"
    handles = [gateway.call_tool("lsp", {"password": secret}), gateway.call_tool("lsk", {"api_token": token})]
    for h in handles:
        with pytest.raises(CallFailed) as info:
            h.result(20)
        assert "cannot access" in info.value.message and "***" in info.value.message
    for value in ({"x": nested}, [listed]):
        h = gateway.call_tool("typed", {"password": value})
        with pytest.raises(CallFailed) as info:
            h.result(20)
        assert "is not of type 'integer'" in info.value.message and "***" in info.value.message
        handles.append(h)
    records = [AuditLog(conn).get(h.call_id) for h in handles]
    wait_until(lambda: "lsk" in worker.log(), 10)
    seen = " ".join([
        *(repr(r.to_dict()) for r in records if r is not None),
        *(repr(e.to_dict()) for h in handles for e in events.history(conn, h.call_id)),
        worker.log(), repr(conn.lrange(keys.FAILURES, 0, -1)),
    ])  # fmt: skip
    assert len(records) == 4 and None not in records
    for value in (secret, token, nested, listed):
        at = seen.find(value)
        assert at < 0, seen[max(0, at - 300) : at + 100]
