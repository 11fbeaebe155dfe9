"""Fleet-wide rate limits (broker/lua/ratelimit.lua): exact windows under racing processes on a plain
Redis and a 3-primary cluster, token reservations settled back, a provider's pause, the timer."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from broker import keys
from broker.calls import CallInfo, Calls
from broker.connection import from_url
from broker.envelope import Envelope
from broker.errors import InvalidSpec
from broker.ratelimits import RateLimit, RateLimiter, estimate_tokens
from broker.states import State
from tests.conftest import wait_until
from tests.redis_stack import ClusterStack
from workers.llm import reported_usage

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CKEY = "tool:rl"
Q = "rl"


def env(call_id: str) -> Envelope:
    return Envelope(call_id=call_id, kind="tool", tool="rl", args={}, traceparent=TP, queue=Q, channel=keys.caller_channel("t", keys.tag(Q)))


def cid(i: Any) -> str:
    return keys.call_id(Q, f"c{i}")


def submit(calls: Calls, i: Any, limit: RateLimit, estimate: int = 0, queue_size: int = 1000) -> bool:
    reply = calls.submit(
        env(cid(i)), ckey=CKEY, queue_size=queue_size, max_attempts=3, timeout=5, concurrency=-1,
        rate_limit=limit, estimate=estimate,
    )
    Calls.check_submit(reply, CKEY, queue_size)
    return int(reply[2]) == 1


def end(calls: Calls, call_id: str, used: int | None = None, state: State = State.DONE, sent: bool = True) -> None:
    info = CallInfo.of(env(call_id), CKEY)
    current = State.PENDING
    path = [State.ROUTING, State.EXECUTING, State.FORMATTING] if state is State.DONE else [State.ROUTING]
    for step in [*path, state]:
        last = step is state
        reply = calls.transition(info, step, attempt=1, current=current, used_tokens=used if last else None, sent=sent or not last)
        assert int(reply[0]) > 0, reply
        current = step


def queued(r: Any) -> list[str]:
    return [c.decode() for c in r.lrange(keys.queue(Q), 0, -1)]


def wake(calls: Calls) -> dict[str, str]:
    return {Q: calls.wake_channel(Q)}


# -- the typed limit and the estimates --------------------------------------------------------


def test_rate_limit_parse_names_the_bad_field() -> None:
    assert RateLimit.parse("tool 't'", {"requests_per_minute": 600, "tokens_per_minute": 60000}) == RateLimit(rpm=600, tpm=60000)
    assert RateLimit.parse("tool 't'", None) is None
    with pytest.raises(InvalidSpec, match=r"rate_limit\.requests_per_minute: expected an integer >= 1, got 0"):
        RateLimit.parse("tool 't'", {"requests_per_minute": 0})
    with pytest.raises(InvalidSpec, match=r"rate_limit\.rpm: unknown key"):
        RateLimit.parse("tool 't'", {"rpm": 5})
    with pytest.raises(InvalidSpec, match="expected a mapping"):
        RateLimit.parse("tool 't'", 5)


def test_partition_shares_add_up_to_the_limit() -> None:
    limit = RateLimit(rpm=601, tpm=60000, rps=10)
    parts = [limit.share(3, i) for i in range(3)]
    assert sum(p.rpm for p in parts) == 601 and sum(p.tpm for p in parts) == 60000 and sum(p.rps for p in parts) == 10
    assert RateLimit(rpm=5).share(3, 0).tpm == -1  # no limit stays none


def test_token_estimate_is_max_tokens_plus_the_prompt_size_and_usage_is_read_back() -> None:
    messages = [{"role": "user", "content": "x" * 400}]
    est = estimate_tokens({"messages": messages, "max_tokens": 50})
    assert 150 <= est <= 170  # 50 + ~(400 chars + JSON) / 4
    assert estimate_tokens({"messages": messages}) >= 1024  # no max_tokens: the default reply estimate
    assert reported_usage({"usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}) == {"in": 7, "out": 5}
    assert reported_usage({"usage": {"total_tokens": 12}}) == {"in": 12, "out": 0}
    assert reported_usage({"choices": []}) is None


# -- the limiter on a real Redis ---------------------------------------------------------------


def test_requests_per_minute_admits_the_limit_and_the_rest_wait_in_order(conn: redis.Redis) -> None:
    calls, limiter = Calls(conn), RateLimiter(conn)
    limit = RateLimit(rpm=3)
    ran = [submit(calls, i, limit) for i in range(5)]
    assert ran == [True, True, True, False, False]
    assert queued(conn) == [cid(0), cid(1), cid(2)]
    assert [m.decode() for m in conn.zrange(keys.waiting(keys.tag(Q), CKEY), 0, -1)] == [cid(3), cid(4)]
    # Not sent yet: the entries wait for their send, no timer (it would fire on a guess).
    assert conn.zcard(keys.rate_due(keys.tag(Q))) == 0
    before = conn.time()
    assert limiter.sent(cid(0), Q, CKEY) == 1
    due = conn.zscore(keys.rate_due(keys.tag(Q)), CKEY)
    assert due is not None and abs(due - (before[0] * 1000 + before[1] // 1000 + 60000)) < 1000
    assert [c.call_id for c in calls.claim([Q], 10, "w", 30)] == [cid(0), cid(1), cid(2)]
    # Ending a sent call frees nothing within the window ...
    end(calls, cid(0))
    assert queued(conn) == []
    # ... but a call that ends before its request was sent gives its entry back: the next one goes.
    end(calls, cid(1), state=State.FAILED, sent=False)
    assert queued(conn) == [cid(3)]
    # A call whose worker did not stamp its send counts from its end (never given back unasked).
    end(calls, cid(2))
    assert queued(conn) == [cid(3)]
    assert conn.zcount(keys.rate_log(keys.tag(Q), CKEY), 0, 1e14) == 2


def test_tokens_are_reserved_at_admission_and_settled_with_the_reported_usage(conn: redis.Redis) -> None:
    calls, limiter = Calls(conn), RateLimiter(conn)
    limit = RateLimit(tpm=1000)
    assert submit(calls, 0, limit, estimate=400)
    assert submit(calls, 1, limit, estimate=400)
    assert not submit(calls, 2, limit, estimate=400)  # 800 + 400 > 1000: waits
    h = keys.rate(keys.tag(Q), CKEY)
    assert int(conn.hget(h, "sum")) == 800
    calls.claim([Q], 10, "w", 30)
    limiter.sent(cid(0), Q, CKEY)
    end(calls, cid(0), used=100)  # used 100 of its 400: 300 back, so the third fits (500 + 400)
    assert int(conn.hget(h, "sum")) == 900
    assert queued(conn) == [cid(2)]
    assert conn.hget(h, "e:" + cid(0)) is None  # its estimate is gone with it


def test_a_pause_holds_every_admission_until_it_ends_then_the_timer_promotes(conn: redis.Redis) -> None:
    calls, limiter = Calls(conn), RateLimiter(conn)
    limit = RateLimit(rps=100)
    assert submit(calls, 0, limit)
    limiter.sent(cid(0), Q, CKEY)
    end_at = limiter.pause(cid(0), Q, CKEY, 0.3)
    assert end_at > time.time()
    assert not submit(calls, 1, limit) and not submit(calls, 2, limit)
    assert limiter.due([Q], 5.0, wake(calls))[0] == 0  # nothing due before the pause ends
    wait_until(lambda: limiter.due([Q], 5.0, wake(calls))[0] == 1, timeout=3, message="the timer")
    assert time.time() >= end_at - 0.01
    assert queued(conn) == [cid(0), cid(1), cid(2)]
    rows = limiter.snapshot([Q])
    assert rows[0]["key"] == CKEY and rows[0]["limits"] == {"requests_per_second": 100} and rows[0]["waiting"] == 0


# -- exact under racing processes ----------------------------------------------------------------


def _race(url: str, p: int, n: int, rps: int, seconds: float, barrier: Any, out: Any) -> None:
    """One racing process: submits ``n`` calls, then works as a worker would (claim, stamp the send,
    end) and runs the limiter's timer, for ``seconds``; reports the Redis time of each send (ms)."""
    conn = from_url(url)
    calls, limiter = Calls(conn), RateLimiter(conn)
    limit = RateLimit(rps=rps)
    barrier.wait()
    for i in range(n):
        submit(calls, f"{p}.{i}", limit)
    sub = conn.pubsub()
    sub.subscribe(calls.wake_channel(Q))
    sends: list[int] = []
    stop = time.time() + seconds
    while time.time() < stop:
        for c in calls.claim([Q], 10, f"w{p}", 30):
            s, us = conn.time()
            sends.append(s * 1000 + us // 1000)
            limiter.sent(c.call_id, Q, CKEY)
            end(calls, c.call_id)
        _, nxt = limiter.due([Q], 1.0, wake(calls))
        timeout = 0.05 if nxt is None else min(0.05, max(0.0, nxt - time.time()))
        sub.get_message(timeout=timeout)  # a wake-up, or the timer's time
    sub.close()
    out.put(sends)


def _run_race(url: str, rps: int = 5, seconds: float = 3.0, procs: int = 4) -> list[int]:
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    per = int(rps * seconds * 2 / procs) + 1  # twice what the window lets through: work always waits
    workers = [ctx.Process(target=_race, args=(url, p, per, rps, seconds, barrier, out)) for p in range(procs)]
    for w in workers:
        w.start()
    sends = sorted(t for _ in workers for t in out.get(timeout=seconds + 30))
    for w in workers:
        w.join(10)
    return sends


def _most_in_window(sends: list[int], window_ms: int) -> int:
    best, lo = 0, 0
    for hi, t in enumerate(sends):
        while sends[lo] <= t - window_ms:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def test_requests_per_second_is_exact_under_racing_processes(redis_url: str) -> None:
    sends = _run_race(redis_url, rps=5, seconds=3.0)
    assert _most_in_window(sends, 1000) == 5  # never more than the limit in any 1 s window ...
    assert len(sends) >= 5 * 2  # ... and the limit used while work waited (3 s: at least 2 full windows)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterStack]:
    with ClusterStack(3, tmp_path_factory.mktemp("rate-cluster")) as c:
        yield c


@pytest.mark.e2e
def test_requests_per_second_is_exact_under_racing_processes_on_a_cluster(cluster: ClusterStack) -> None:
    for port in cluster.ports:
        cluster.node(port).flushall()
    sends = _run_race(cluster.url(), rps=5, seconds=3.0)
    assert _most_in_window(sends, 1000) == 5
    assert len(sends) >= 5 * 2


def test_a_tool_spec_rate_limit_is_checked_at_registration() -> None:
    from workers.specs import check_spec

    base = {"name": "t", "executor": "python", "function": "workers.executors.builtin:echo"}
    spec = check_spec({**base, "rate_limit": {"requests_per_second": 3}})
    assert RateLimit.parse("t", spec.config["rate_limit"]) == RateLimit(rps=3)
    with pytest.raises(InvalidSpec, match=r"rate_limit\.requests_per_hour: unknown key"):
        check_spec({**base, "rate_limit": {"requests_per_hour": 3}})


def test_a_tool_rate_limit_no_partition_could_use_is_refused_at_registration() -> None:
    from workers.specs import check_spec

    base = {"name": "t", "executor": "python", "function": "workers.executors.builtin:echo"}
    # 2 a second over 4 partitions: two shares of 0, whose calls would wait for ever (half of all calls).
    with pytest.raises(InvalidSpec, match=r"rate_limit\.requests_per_second: expected at least queue_partitions \(4\)"):
        check_spec({**base, "queue_partitions": 4, "rate_limit": {"requests_per_second": 2}})
    with pytest.raises(InvalidSpec, match=r"rate_limit\.requests_per_minute: expected at least queue_partitions"):
        check_spec({**base, "queue_partitions": 3, "rate_limit": {"requests_per_second": 9, "requests_per_minute": 2}})
    assert check_spec({**base, "queue_partitions": 4, "rate_limit": {"requests_per_second": 4}}).name == "t"
    # A tool call reserves no tokens: a tokens_per_minute on a tool would never hold anything back.
    with pytest.raises(InvalidSpec, match=r"rate_limit\.tokens_per_minute: counts LLM tokens"):
        check_spec({**base, "rate_limit": {"tokens_per_minute": 1000}})


def test_model_rate_limits_and_daily_budgets_are_read_from_config() -> None:
    from broker.errors import ConfigError
    from broker.settings import model_settings
    from workers.policy import Policy

    m = model_settings({"rate_limits": {"openai/gpt-4o": {"requests_per_minute": 600}, "m": {"tokens_per_minute": 9}}})
    assert m.rate_limit_for("openai", "gpt-4o") == RateLimit(rpm=600)
    assert m.rate_limit_for("other", "m") == RateLimit(tpm=9) and m.rate_limit_for("other", "gpt-4o") is None
    with pytest.raises(ConfigError, match=r"model\.rate_limits\.m\.requests_per_minute: expected an integer >= 1"):
        model_settings({"rate_limits": {"m": {"requests_per_minute": -1}}})
    policy = Policy.from_settings({"principals": {"alice": {"daily_tokens": 100}, "*": {"grants": []}}})
    assert policy.daily_tokens("alice") == 100 and policy.daily_tokens("bob") is None
    with pytest.raises(ConfigError, match="daily_tokens"):
        Policy.from_settings({"principals": {"alice": {"daily_tokens": "lots"}}})


def test_a_429s_wait_is_read_from_retry_after_or_the_reset_headers() -> None:
    from workers.providers.backoff import parse_reset, pause_seconds

    assert pause_seconds({"Retry-After": "2"}) == 2.0
    assert pause_seconds({"retry-after-ms": "250", "Retry-After": "9"}) == 0.25
    assert parse_reset("6m0s") == 360.0 and parse_reset("250ms") == 0.25 and parse_reset("1h2m3.5s") == 3723.5
    assert parse_reset("soon") is None
    headers = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1.5s",
               "x-ratelimit-remaining-tokens": "900", "x-ratelimit-reset-tokens": "30s"}
    assert pause_seconds(headers) == 1.5  # only the exhausted kind's reset
    assert pause_seconds({}) is None


def test_a_call_admitted_again_without_settling_keeps_its_earlier_entry_counted(conn: redis.Redis) -> None:
    calls = Calls(conn)
    limit = RateLimit(rpm=2)
    assert submit(calls, 0, limit)
    # Whatever path admits the same call again (a requeue), its first entry is not orphaned: it counts
    # (as sent, from now) and the call takes a second one.
    info = CallInfo.of(env(cid(0)), CKEY)
    calls.transition(info, State.ROUTING, attempt=1, current=State.PENDING)
    calls.transition(info, State.RETRYING, attempt=1, current=State.ROUTING, fields={keys.F_ATTEMPT: 2})
    conn.hset(keys.rate(keys.tag(Q), CKEY), "m:" + cid(0), "1")  # (as if the release had not settled it)
    calls.requeue(info, attempt=2)
    log = keys.rate_log(keys.tag(Q), CKEY)
    assert conn.zcard(log) == 2 and conn.zscore(log, "1") < 1e15  # the first stamped, the second unsent
    assert not submit(calls, 1, limit)  # 2 of 2 used: the next waits
