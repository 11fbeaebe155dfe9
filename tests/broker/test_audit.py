"""Audit log: records, append/get/list/export, pipelines, retention, JSONL mirror (fakeredis and real Redis)."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from broker.audit import SUMMARY_LIMIT, AuditLog, AuditRecord, summarize
from broker.config import load_settings
from broker.errors import ConfigError, DecodeError, PermissionDenied
from broker.logs import MASK, keyed_hash, verify_hash
from tests.broker.test_redact import CORPUS
from tests.conftest import wait_until


@pytest.fixture
def fake() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


@pytest.fixture
def real(redis_url: str) -> Iterator[redis.Redis]:
    """The test database (``HERMES_TEST_REDIS_URL``), not whatever answers on 6379."""
    client = redis.Redis.from_url(redis_url)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def prefix(real: redis.Redis) -> Iterator[str]:
    p = f"test:audit:{uuid.uuid4().hex}"
    yield p
    for key in real.scan_iter(p + "*"):
        real.delete(key)


def rec(call_id: str, **kw: Any) -> AuditRecord:
    base: dict[str, Any] = {
        "kind": "tool",
        "state": "done",
        "tool_name": "get_weather",
        "principal": "agent-a",
    }
    base.update(kw)
    return AuditRecord.of(call_id=call_id, **base)


# --- the record ---------------------------------------------------------------------------------


def test_record_of_redacts_args_hashes_sensitive_ones_and_round_trips() -> None:
    args = {"city": "北京", "api_key": "abc123", "card": "4111111111111111", "note": "Bearer abcdef123456"}
    r = AuditRecord.of(
        call_id="c1",
        kind="tool",
        state="done",
        tool_name="pay",
        args=args,
        sensitive=("card",),
        result={"ok": True, "token": "t0k3n"},
        middleware_trace=[{"source": "jail", "reason": "rewrote url https://u:pw123@h/x"}],
        duration_ms=12.5,
        trace_id="0af7651916cd43dd8448eb211c80319c",
        parent_call_id="llm-1",
        tool_call_id="call_1",
        digest=keyed_hash(b"k"),
    )
    assert args["api_key"] == "abc123"  # the caller's args are untouched
    assert r.args == {
        "city": "北京",
        "api_key": MASK,
        "card": r.sensitive_hashes["card"],
        "note": "Bearer ***",
    }
    assert verify_hash("4111111111111111", r.sensitive_hashes["card"], keyed_hash(b"k"))
    assert r.result_summary == "{'ok': True, 'token': '***'}"
    assert r.middleware_trace == [{"source": "jail", "reason": "rewrote url https://u:***@h/x"}]
    assert AuditRecord.decode(r.encode()) == r


def test_llm_record_keeps_model_params_without_the_conversation_or_keys() -> None:
    request = {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": "my password is hunter2"}],
        "temperature": 0.2,
        "max_tokens": 512,
        "api_key": "sk-" + "x" * 30,
    }
    r = AuditRecord.of(call_id="l1", kind="llm", state="done", request=request)
    assert r.model == "deepseek-chat" and r.name == "deepseek-chat"
    assert r.model_params == {"temperature": 0.2, "max_tokens": 512, "api_key": MASK}


def test_errors_are_recorded_by_type_with_redacted_messages() -> None:
    err = PermissionDenied("denied for token=abcdef123", tool="x")
    r = rec("e1", state="failed", error=err)
    assert (r.error_type, r.error_message) == ("permission_denied", "denied for token=***")
    r2 = rec("e2", state="failed", error=ValueError("redis://:pw@h broke"))
    assert (r2.error_type, r2.error_message) == ("ValueError", "redis://:***@h broke")
    r3 = rec("e3", state="failed", error={"type": "tool_timeout", "message": "slow"})
    assert r3.error_type == "tool_timeout"


def test_result_summary_stays_within_one_kib_without_splitting_characters() -> None:
    big = {"rows": [{"city": "北京", "temp": i} for i in range(10_000)]}
    s = summarize(big)
    assert len(s.encode("utf-8")) <= SUMMARY_LIMIT and s.endswith("...(truncated)")
    assert s.startswith("{'rows': [{'city': '北京', 'temp': 0}")
    text = "天气" * 2000
    t = summarize(text)
    assert len(t.encode("utf-8")) <= SUMMARY_LIMIT and t.startswith("天气天气")
    assert summarize("short") == "short"


def test_summary_of_a_huge_result_still_masks_secrets_it_shows() -> None:
    s = summarize([{"password": "hunter22", "x": "sk-" + "a" * 40}] + list(range(100_000)))
    assert "hunter22" not in s and "sk-aaaa" not in s and s.startswith("[{'password': '***', 'x': '***'}")


def test_decode_ignores_unknown_fields_and_refuses_other_versions() -> None:
    data = rec("c1").to_dict() | {"added_later": 1}
    assert AuditRecord.from_dict(data).call_id == "c1"
    with pytest.raises(DecodeError):
        AuditRecord.from_dict(data | {"version": 99})
    with pytest.raises(DecodeError):
        AuditRecord.decode(b"\xc1")


def test_the_redaction_corpus_never_reaches_an_encoded_record() -> None:
    args = {f"a{i}": text for i, (_, text, _) in enumerate(CORPUS)}
    r = rec("c1", args=args, result=[t for _, t, _ in CORPUS], error=RuntimeError(CORPUS[0][1]))
    blob = r.encode() + r.to_json().encode()
    for shape, _, secret in CORPUS:
        assert secret.encode() not in blob, shape


# --- the log on fakeredis -----------------------------------------------------------------------


def test_append_get_and_list_with_filters(fake: fakeredis.FakeRedis) -> None:
    log = AuditLog(fake, "t:audit")
    log.append(rec("c1", tool_name="get_weather", principal="agent-a", state="done"))
    log.append(rec("c2", tool_name="rm_rf", principal="agent-b", state="failed"))
    log.append(rec("c3", tool_name="get_weather", principal="agent-b", state="done"))
    log.append(AuditRecord.of(call_id="l1", kind="llm", state="done", request={"model": "m1"}))
    assert len(log) == 4
    got = log.get("c2")
    assert got is not None and got.tool_name == "rm_rf" and got.principal == "agent-b"
    assert log.get("nope") is None
    assert [r.call_id for r in log.list()] == ["l1", "c3", "c2", "c1"]  # newest first
    assert [r.call_id for r in log.list(tool="get_weather")] == ["c3", "c1"]
    assert [r.call_id for r in log.list(principal="agent-b", state="done")] == ["c3"]
    assert [r.call_id for r in log.list(tool="m1")] == ["l1"]
    assert [r.call_id for r in log.list(limit=2)] == ["l1", "c3"]
    assert log.list(limit=0) == [] and log.list(limit=-1) == []  # (no record is read for a limit of none)


def test_list_since_uses_append_time(fake: fakeredis.FakeRedis) -> None:
    log = AuditLog(fake, "t:audit")
    log.append(rec("old"))
    entries = fake.xrange("t:audit")
    first_ms = int(entries[0][0].split(b"-")[0])
    assert [r.call_id for r in log.list(since=(first_ms + 1) / 1000)] == []
    assert [r.call_id for r in log.list(since=first_ms / 1000)] == ["old"]


def test_list_pages_through_more_records_than_one_batch(fake: fakeredis.FakeRedis) -> None:
    log = AuditLog(fake, "t:audit")
    for i in range(1200):
        log.append(rec(f"c{i}", principal="p" if i % 100 == 0 else "q"))
    assert [r.call_id for r in log.list(principal="p")] == [f"c{i}" for i in range(1100, -1, -100)]
    buf = io.StringIO()
    assert log.export(buf, principal="p") == 12


def test_export_writes_jsonl_oldest_first(fake: fakeredis.FakeRedis) -> None:
    log = AuditLog(fake, "t:audit")
    for i in range(3):
        log.append(rec(f"c{i}", args={"i": i, "token": "x1y2z3"}))
    buf = io.StringIO()
    assert log.export(buf) == 3
    rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [r["call_id"] for r in rows] == ["c0", "c1", "c2"]
    assert rows[1]["args"] == {"i": 1, "token": MASK}
    assert AuditRecord.from_dict(rows[2]) == log.get("c2")


def test_a_pipeline_append_waits_for_its_creator_to_execute(fake: fakeredis.FakeRedis) -> None:
    log = AuditLog(fake, "t:audit")
    pipe = fake.pipeline()
    pipe.set("t:call:c1", "done")  # the lead's finishing writes share the round trip
    log.append(rec("c1"), pipeline=pipe)
    assert len(log) == 0 and log.get("c1") is None
    pipe.execute()
    assert fake.get("t:call:c1") == b"done"
    assert log.get("c1") is not None


def test_count_retention_trims_stream_and_index_together(fake: fakeredis.FakeRedis) -> None:
    log = AuditLog(fake, "t:audit", maxlen=5, approximate=False)
    for i in range(12):
        log.append(rec(f"c{i}"))
    assert len(log) == 5
    assert [r.call_id for r in log.list()] == [f"c{i}" for i in range(11, 6, -1)]
    assert log.get("c3") is None and log.get("c11") is not None
    # The index never holds more than the stream plus the entries sharing the oldest kept millisecond.
    oldest_ms = int(fake.xrange("t:audit", count=1)[0][0].split(b"-")[0])
    assert all(score >= oldest_ms for _, score in fake.zrange("t:audit:idx", 0, -1, withscores=True))


def test_jsonl_mirror_writes_whole_lines_from_many_threads(fake: fakeredis.FakeRedis, tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(fake, "t:audit", jsonl_path=path)

    def writer(t: int) -> None:
        for i in range(50):
            log.append(rec(f"t{t}-{i}", result="x" * 3000))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 200
    assert {json.loads(line)["call_id"] for line in lines} == {
        f"t{t}-{i}" for t in range(4) for i in range(50)
    }


def test_from_settings_reads_retention_and_config_rejects_typos(
    fake: fakeredis.FakeRedis, tmp_path: Path
) -> None:
    (tmp_path / "config.yaml").write_text(
        f"audit: {{maxlen: 10, max_age: 3600, approximate: false, jsonl: {tmp_path / 'a.jsonl'}}}\n"
    )
    log = AuditLog.from_settings(fake, load_settings(tmp_path, environ={}).audit)
    assert (log.maxlen, log.max_age, log.approximate, log.jsonl_path) == (10, 3600.0, False, tmp_path / "a.jsonl")
    assert AuditLog.from_settings(fake, None).maxlen == 100_000
    assert AuditLog.from_settings(fake, load_settings(tmp_path / "none", environ={}).audit).maxlen == 100_000
    for bad, message in (
        ("{max_len: 5}", r"audit: unknown key\(s\) \['max_len'\]"),
        ("{maxlen: many}", "audit: maxlen and max_age must be numbers"),
        ("{max_age: -1}", "audit: maxlen and max_age must not be negative"),
        ("{approximate: maybe}", "audit.approximate: expected true or false"),
    ):
        (tmp_path / "config.yaml").write_text(f"audit: {bad}\n")
        with pytest.raises(ConfigError, match=message):
            load_settings(tmp_path, environ={})


# --- the log on the real Redis ------------------------------------------------------------------


def test_real_redis_append_in_a_pipeline_then_get_list_export(real: redis.Redis, prefix: str) -> None:
    log = AuditLog(real, prefix, maxlen=1000)
    pipe = real.pipeline(transaction=True)
    for i in range(20):
        log.append(
            rec(f"c{i}", principal="agent-a" if i % 2 else "agent-b", args={"password": "pw", "i": i}), pipe
        )
    pipe.execute()
    assert len(log) == 20
    got = log.get("c7")
    assert got is not None and got.args == {"password": MASK, "i": 7}
    assert [r.call_id for r in log.list(principal="agent-a", limit=3)] == ["c19", "c17", "c15"]
    buf = io.StringIO()
    assert log.export(buf, principal="agent-b") == 10
    assert real.exists(prefix + ":idx")


def test_real_redis_exact_count_retention(real: redis.Redis, prefix: str) -> None:
    log = AuditLog(real, prefix, maxlen=3, approximate=False)
    for i in range(10):
        log.append(rec(f"c{i}"))
    assert [r.call_id for r in log.list()] == ["c9", "c8", "c7"]
    assert log.get("c0") is None
    oldest_ms = int(real.xrange(prefix, count=1)[0][0].split(b"-")[0])
    assert all(score >= oldest_ms for _, score in real.zrange(prefix + ":idx", 0, -1, withscores=True))


def test_real_redis_age_retention_drops_records_older_than_max_age(real: redis.Redis, prefix: str) -> None:
    now = [time.time()]
    log = AuditLog(real, prefix, maxlen=None, max_age=3600, approximate=False, clock=lambda: now[0])
    log.append(rec("old"))
    old_ms = int(real.xrange(prefix)[-1][0].split(b"-")[0])
    # Redis's clock in a later millisecond than "old"'s entry id, so the cut-off can fall between the two entries.
    wait_until(lambda: _server_ms(real) > old_ms, timeout=5, interval=0.001, message="a later millisecond")
    log.append(rec("new"))
    new_ms = int(real.xrange(prefix)[-1][0].split(b"-")[0])
    now[0] = new_ms / 1000 + 3600  # an hour after "new" was written: "old" is past max_age, "new" is not
    log.trim()
    assert [r.call_id for r in log.list()] == ["new"]
    assert log.get("old") is None and real.zscore(prefix + ":idx", "old") is None
    now[0] += 10
    log.trim()
    assert len(log) == 0 and not real.exists(prefix + ":idx")


def _server_ms(conn: redis.Redis) -> int:
    seconds, micros = conn.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_record_keeps_only_the_start_of_a_huge_argument() -> None:
    # Scanning all 20 MB of it for secrets took ~5 s holding the GIL, which stalled the whole worker.
    huge = "a" * 20_000_000
    r = AuditRecord.of(
        call_id="big", kind="tool", state="done", tool_name="echo", args={"x": huge}, result={"x": huge}
    )
    assert r.args is not None and r.args["x"].startswith("a" * 1000)
    assert r.args["x"].endswith(f"…[{20_000_000 - 64 * 1024} more characters]")


def test_a_record_built_while_redis_refuses_the_key_masks_a_sensitive_value_and_the_key_comes_later() -> None:
    # At maxmemory (or during an outage) the deployment's key cannot be made: the call still ends, its record
    # masks the value (the worker's digest raised, and the call never ended); once Redis answers, hashes come.
    server = fakeredis.FakeServer()
    log = AuditLog(fakeredis.FakeRedis(server=server))
    server.connected = False
    assert log.digest_now() is None
    record = AuditRecord.of(call_id="c1", kind="tool", state="done", args={"pin": "123456"}, sensitive=("pin",),
                            digest=log.digest_now(), tool_name="t")
    assert record.args == {"pin": MASK} and record.sensitive_hashes == {}
    server.connected = True
    assert log.digest_now() is not None and log.digest_now()("123456").startswith("hmac-sha256:")
