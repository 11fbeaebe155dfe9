"""The http executor: values placed (never pasted), body templates, errors, caps, and the SSRF guard."""

from __future__ import annotations

import threading
import time
from urllib.parse import quote

import pytest

from broker.errors import (
    CallCancelled,
    DestinationBlocked,
    ExecutorError,
    InvalidArgs,
    InvalidSpec,
    OutputTooLarge,
    ToolTimeout,
)
from broker.toolspec import ToolSpec
from workers.executors import http as httpexec
from workers.executors import netguard
from workers.specs import check_spec

from .http_server import Recorder


@pytest.fixture(scope="module")
def server():
    srv = Recorder()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def canary():
    """A loopback listener the guarded executor must never reach."""
    srv = Recorder()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def ex():
    executor = httpexec.HttpExecutor({"allow_networks": ["127.0.0.1/32"]})
    yield executor
    executor.close()


@pytest.fixture(scope="module")
def guarded():
    executor = httpexec.HttpExecutor({})
    yield executor
    executor.close()


@pytest.fixture(autouse=True)
def fake_dns(monkeypatch):
    """Hostile DNS: names under .test resolve where the attacker wants."""
    real = netguard.resolve_host
    table = {
        "rebind.test": ["127.0.0.1"],
        "mixed.test": ["93.184.216.34", "127.0.0.1"],
        "meta.test": ["169.254.169.254"],
        "v6loop.test": ["::1"],
        "api.test": ["127.0.0.1"],
    }
    monkeypatch.setattr(netguard, "resolve_host", lambda host, port: table.get(host) or real(host, port))


def spec(**config) -> ToolSpec:
    return check_spec({"name": "t", "executor": "http", **config})


def test_get_sends_fields_as_query_and_parses_json(ex, server, make_ctx):
    out = ex.run(spec(endpoint=f"{server.base}/weather"), {"city": "北京", "days": 3}, make_ctx())
    assert out["method"] == "GET" and out["query"] == [["city", "北京"], ["days", "3"]]


def test_post_sends_fields_as_form(ex, server, make_ctx):
    out = ex.run(spec(method="POST", endpoint=f"{server.base}/f"), {"a": "1&b=2", "l": [1, 2]}, make_ctx())
    assert out["headers"]["content-type"] == "application/x-www-form-urlencoded"
    assert out["body"] == "a=1%26b%3D2&l=1&l=2"


def test_body_template_is_parsed_then_filled_with_typed_values(ex, server, make_ctx):
    s = spec(
        method="POST",
        endpoint=f"{server.base}/t",
        body_template="{query: {{city}}, opts: {unit: {{unit}}, n: {{n}}}, note: 'in {{city}}'}",
    )
    out = ex.run(s, {"city": 'x", "admin": true, "y": "', "unit": "celsius", "n": 3}, make_ctx())
    import json

    assert json.loads(out["body"]) == {
        "query": 'x", "admin": true, "y": "',
        "opts": {"unit": "celsius", "n": 3},
        "note": 'in x", "admin": true, "y": "',
    }


def test_body_template_from_executor_settings(server, make_ctx):
    executor = httpexec.HttpExecutor({"allow_networks": ["127.0.0.1/8"], "body_template": "{q: {{city}}}"})
    try:
        out = executor.run(spec(method="POST", endpoint=f"{server.base}/s"), {"city": "上海"}, make_ctx())
    finally:
        executor.close()
    assert out["body"] == '{"q":"上海"}' or out["body"].replace(" ", "") == '{"q":"上海"}'


def test_a_body_to_send_without_a_method_is_a_post(ex, server, make_ctx):
    """The seed's config.yaml puts body_template under executors.http and the tool names no method: a
    body is sent with POST (a GET with a JSON body is dropped or refused by many servers and proxies)."""
    executor = httpexec.HttpExecutor({"allow_networks": ["127.0.0.1/8"], "body_template": "{query: {{city}}}"})
    try:
        out = executor.run(spec(endpoint=f"{server.base}/weather"), {"city": "北京"}, make_ctx())
    finally:
        executor.close()
    assert out["method"] == "POST" and out["headers"]["content-type"] == "application/json"
    sent = ex.run(spec(endpoint=f"{server.base}/j", send_args_as="json"), {"a": 1}, make_ctx())
    assert sent["method"] == "POST" and sent["body"].replace(" ", "") == '{"a":1}'
    assert ex.run(spec(endpoint=f"{server.base}/q"), {"a": 1}, make_ctx())["method"] == "GET"


def test_path_placeholder_is_percent_encoded_and_removed_from_query(ex, server, make_ctx):
    out = ex.run(spec(endpoint=f"{server.base}/users/{{{{id}}}}"), {"id": "a/b c", "x": 1}, make_ctx())
    assert out["raw_path"] == "/users/a%2Fb%20c" and out["query"] == [["x", "1"]]


def test_headers_are_filled_and_trace_context_forwarded(ex, server, make_ctx):
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    s = spec(endpoint=f"{server.base}/h", headers={"X-Api-Key": "k1", "X-User": "{{user}}"})
    out = ex.run(s, {"user": "bob"}, make_ctx(traceparent=tp, tracestate="a=b", baggage="tenant=acme"))
    h = out["headers"]
    assert (
        h["x-api-key"] == "k1"
        and h["x-user"] == "bob"
        and h["traceparent"] == tp
        and h["tracestate"] == "a=b"
        and h["baggage"] == "tenant=acme"
    )
    assert out["query"] == []
    plain = ex.run(s, {"user": "bob"}, make_ctx())["headers"]
    assert not {"traceparent", "tracestate", "baggage"} & set(plain), "nothing invented without a context"


def test_header_injection_is_refused(ex, server, make_ctx):
    s = spec(endpoint=f"{server.base}/h", headers={"X-User": "{{user}}"})
    with pytest.raises(InvalidArgs, match="CR, LF"):
        ex.run(s, {"user": "bob\r\nX-Admin: 1"}, make_ctx())


def test_placeholders_in_host_or_header_name_are_spec_errors(ex, make_ctx):
    with pytest.raises(InvalidSpec, match="host"):
        ex.run(spec(endpoint="http://{{host}}/x"), {"host": "evil"}, make_ctx())
    with pytest.raises(InvalidSpec, match="header names"):
        ex.run(spec(endpoint="http://127.0.0.1/x", headers={"{{h}}": "v"}), {"h": "Host"}, make_ctx())


def test_text_response_is_returned_as_text(ex, server, make_ctx):
    assert ex.run(spec(endpoint=f"{server.base}/text"), {}, make_ctx()) == "plain 北京\n"


def test_error_status_is_executor_error_with_status_and_excerpt(ex, server, make_ctx):
    with pytest.raises(ExecutorError) as info:
        ex.run(spec(endpoint=f"{server.base}/status/404"), {"msg": "no such city"}, make_ctx())
    assert info.value.details["status"] == 404 and "backend says no: no such city" in str(info.value)
    assert info.value.retryable is False
    with pytest.raises(ExecutorError) as info:
        ex.run(spec(endpoint=f"{server.base}/status/503"), {}, make_ctx())
    assert info.value.details["status"] == 503 and info.value.retryable is True


def test_oversize_response_is_output_too_large(ex, server, make_ctx):
    with pytest.raises(OutputTooLarge):
        ex.run(spec(endpoint=f"{server.base}/big", max_output=100_000), {}, make_ctx())


def test_a_compressed_body_is_held_to_the_cap_as_it_inflates(ex, server, make_ctx):
    import tracemalloc

    assert ex.run(spec(endpoint=f"{server.base}/gzip?size=1000"), {}, make_ctx()) == "0" * 1000
    # A gzip bomb: 200 KB sent, 200 MiB inflated (httpx inflated each 64 KiB read whole, 64 MiB, before the cap).
    tracemalloc.start()
    try:
        with pytest.raises(OutputTooLarge):
            ex.run(spec(endpoint=f"{server.base}/gzip?size={200 << 20}"), {}, make_ctx())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # the 1 MiB cap, the body and its copies: not the bomb


def test_timeout_is_tool_timeout(ex, server, make_ctx):
    with pytest.raises(ToolTimeout):
        ex.run(spec(endpoint=f"{server.base}/slow"), {}, make_ctx(timeout=0.5))


def test_a_server_dribbling_its_headers_is_held_to_the_tools_timeout(ex, server, make_ctx):
    # Every read gets a byte within its timeout; the call's deadline ends it (it ran for ever).
    started = time.monotonic()
    with pytest.raises(ToolTimeout):
        ex.run(spec(endpoint=f"{server.base}/dribble"), {}, make_ctx(timeout=0.8))
    assert time.monotonic() - started < 5


def test_cancellation_while_server_is_silent(ex, server, make_ctx):
    ctx = make_ctx(timeout=30)
    threading.Timer(0.3, ctx.cancelled.set).start()
    with pytest.raises(CallCancelled):
        ex.run(spec(endpoint=f"{server.base}/slow"), {}, ctx)


def test_cancellation_while_body_streams(ex, server, make_ctx):
    ctx = make_ctx(timeout=30)
    threading.Timer(0.3, ctx.cancelled.set).start()
    with pytest.raises(CallCancelled):
        ex.run(spec(endpoint=f"{server.base}/drip"), {}, ctx)


def test_redirects_are_followed_within_allowed_hosts(ex, server, make_ctx):
    target = f"{server.base}/landed?x=1"
    out = ex.run(spec(endpoint=f"{server.base}/redirect?to={quote(target, safe='')}"), {}, make_ctx())
    assert out["raw_path"] == "/landed"


def test_too_many_redirects_is_executor_error(ex, server, make_ctx):
    url = f"{server.base}/end"
    for _ in range(7):
        url = f"{server.base}/redirect?to={quote(url, safe='')}"
    with pytest.raises(ExecutorError, match="redirects"):
        ex.run(spec(endpoint=url), {}, make_ctx())


def test_spec_headers_are_dropped_when_a_redirect_leaves_the_origin(ex, server, make_ctx):
    other = f"http://api.test:{server.server_address[1]}/landed"  # same IP, different origin
    s = spec(endpoint=f"{server.base}/redirect?to={quote(other, safe='')}", headers={"X-Api-Key": "secret"})
    executor = httpexec.HttpExecutor({"allow_networks": ["127.0.0.1/32"]})
    try:
        out = executor.run(s, {}, make_ctx())
    finally:
        executor.close()
    assert "x-api-key" not in out["headers"] and out["headers"]["host"].startswith("api.test")


def test_name_is_resolved_once_and_the_checked_address_is_used(ex, server, make_ctx):
    out = ex.run(spec(endpoint=f"http://api.test:{server.server_address[1]}/pinned"), {}, make_ctx())
    assert out["raw_path"] == "/pinned" and out["headers"]["host"] == f"api.test:{server.server_address[1]}"


def ssrf_urls(port: int) -> list[str]:
    return [
        f"http://127.0.0.1:{port}/",
        f"http://localhost:{port}/",
        f"http://LOCALHOST:{port}/",
        f"http://0:{port}/",
        f"http://[::1]:{port}/",
        f"http://0.0.0.0:{port}/",
        f"http://127.1:{port}/",
        f"http://2130706433:{port}/",
        f"http://0x7f000001:{port}/",
        f"http://017700000001:{port}/",
        f"http://[::ffff:127.0.0.1]:{port}/",
        f"http://[0:0:0:0:0:ffff:7f00:1]:{port}/",
        f"http://rebind.test:{port}/",
        f"http://mixed.test:{port}/",
        f"http://v6loop.test:{port}/",
        "http://meta.test/latest/meta-data/",
        "http://169.254.169.254/latest/meta-data/iam/",
        "http://[fd00:ec2::254]/latest/",
        "http://100.100.100.200/latest/meta-data/",
        "http://10.0.0.1/",
        "http://172.16.5.4/",
        "http://192.168.1.1/admin",
        "http://100.64.0.1/",
        "http://224.0.0.1/",
        "http://240.0.0.1/",
        "http://255.255.255.255/",
        "http://[fe80::1]/",
        "http://[fc00::1]/",
        "http://[64:ff9b::7f00:1]/",
        "http://[2002:7f00:1::]/",
        "http://198.18.0.1/",
        "https://127.0.0.1:{port}/".replace("{port}", str(port)),
    ]


def test_ssrf_corpus_is_refused_and_never_connects(guarded, canary, make_ctx):
    urls = ssrf_urls(canary.server_address[1])
    assert len(urls) >= 30
    for url in urls:
        with pytest.raises(DestinationBlocked):
            guarded.run(spec(endpoint=url), {}, make_ctx())
    assert canary.connections == 0 and canary.requests == []


def test_a_loopback_refusal_says_how_to_allow_the_service(guarded, make_ctx):
    # The seed's get_weather points at 127.0.0.1:8081: the refusal tells the operator the setting to use.
    with pytest.raises(DestinationBlocked) as info:
        guarded.run(spec(endpoint="http://127.0.0.1:8081/weather"), {}, make_ctx())
    message = str(info.value)
    assert "127.0.0.1 is not a public address (loopback)" in message
    assert 'executors.http.allow_networks: ["127.0.0.1/32"]' in message and 'allow_hosts: ["127.0.0.1"]' in message


def test_redirects_to_private_addresses_are_refused(server, canary, make_ctx):
    # Only the first hop's host is allowed; every redirect target must pass the guard on its own.
    executor = httpexec.HttpExecutor({"allow_hosts": ["127.0.0.1"]})
    port = canary.server_address[1]
    targets = [
        f"http://localhost:{port}/",
        f"http://[::1]:{port}/",
        f"http://rebind.test:{port}/",
        f"http://2130706433:{port}/",
        "http://169.254.169.254/latest/meta-data/",
        f"http://0.0.0.0:{port}/",
    ]
    try:
        for code in (301, 302, 307, 308):
            for target in targets:
                url = f"{server.base}/redirect?code={code}&to={quote(target, safe='')}"
                with pytest.raises(DestinationBlocked):
                    executor.run(spec(endpoint=url), {}, make_ctx())
    finally:
        executor.close()
    assert canary.connections == 0


def test_metadata_is_refused_even_when_allow_listed(make_ctx):
    executor = httpexec.HttpExecutor({"allow_networks": ["169.254.0.0/16"], "allow_hosts": ["meta.test"]})
    try:
        for url in ("http://169.254.169.254/", "http://meta.test/"):
            with pytest.raises(DestinationBlocked, match="metadata"):
                executor.run(spec(endpoint=url), {}, make_ctx())
    finally:
        executor.close()


HOSTILE_VALUES = [
    "../../admin",
    "..%2f..%2fadmin",
    "%2e%2e/%2e%2e/etc/passwd",
    "a/b",
    "a?admin=true",
    "a#frag",
    "a&admin=true",
    "a=b",
    "@evil.example",
    "http://evil.example/",
    "//evil.example",
    "\\\\evil\\share",
    "a b",
    "a+b",
    "%00",
    "\u202e",
    "北京",
    "' OR 1=1 --",
    "<script>alert(1)</script>",
    "${jndi:ldap://x}",
    "{{other}}",
    ";id",
    "|id",
    "$(id)",
    "`id`",
    "\ttab",
    "%",
    "%%",
    "..",
    ".",
    "~",
    "a\u0000b",
]


def test_hostile_path_and_query_values_stay_in_their_slot(ex, server, make_ctx):
    assert len(HOSTILE_VALUES) >= 30
    s = spec(endpoint=f"{server.base}/items/{{{{id}}}}?q={{{{q}}}}")
    for value in HOSTILE_VALUES:
        if value in (".", ".."):
            with pytest.raises(InvalidArgs, match="path value"):
                ex.run(s, {"id": value, "q": value, "other": "x"}, make_ctx())
            continue
        out = ex.run(s, {"id": value, "q": value, "other": "x"}, make_ctx())
        assert out["raw_path"] == "/items/" + quote(value, safe=""), value
        assert [k for k, _ in out["query"]] == ["q", "other"], value
        assert out["query"][0][1] == value, value


def test_hostile_values_in_form_and_template_bodies_add_no_fields(ex, server, make_ctx):
    import json
    from urllib.parse import parse_qsl

    form = spec(method="POST", endpoint=f"{server.base}/form")
    tmpl = spec(method="POST", endpoint=f"{server.base}/tmpl", body_template='{"q": {{q}}, "fixed": 1}')
    for value in HOSTILE_VALUES:
        out = ex.run(form, {"q": value}, make_ctx())
        assert parse_qsl(out["body"], keep_blank_values=True) == [("q", value)], value
        out = ex.run(tmpl, {"q": value}, make_ctx())
        assert json.loads(out["body"]) == {"q": value, "fixed": 1}, value


def test_guard_disabled_only_by_settings(server, make_ctx):
    executor = httpexec.HttpExecutor({"ssrf_guard": False})
    try:
        assert executor.run(spec(endpoint=f"{server.base}/open"), {}, make_ctx())["raw_path"] == "/open"
    finally:
        executor.close()


def test_the_inflater_reads_gzip_zlib_and_headerless_deflate_in_capped_pieces() -> None:
    import gzip
    import zlib

    from workers.executors import Inflater

    body = b"hermes " * 5000
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # deflate without its zlib header, as some servers send it
    bare = raw.compress(body) + raw.flush()
    for coding, sent in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)), ("deflate", bare)):
        inflater = Inflater(coding, 1000, "t")
        pieces = [p for chunk in (sent[:7], sent[7:], b"") for p in inflater.pieces(chunk)]
        assert b"".join(pieces) == body and max(map(len, pieces)) <= 1000, coding
    with pytest.raises(ExecutorError, match="corrupt"):
        list(Inflater("gzip", 1000, "t").pieces(b"not gzip at all"))
    with pytest.raises(ExecutorError, match="not asked for"):
        Inflater("br", 1000, "t")
