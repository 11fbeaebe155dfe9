"""Redaction: secret keys, secret shapes in strings, sensitive-field hashes, the structlog processor."""

from __future__ import annotations

import copy
import io
import json
from typing import Any

import pytest
import structlog

from broker.logs import (
    MASK,
    RedactProcessor,
    hash_value,
    is_secret_key,
    keyed_hash,
    redact,
    redact_processor,
    redact_text,
    sensitive_hashes,
    verify_hash,
)

# Synthetic secrets built at run time so no scanner mistakes this file for a leak.
A36 = "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
HEX32 = "0123456789abcdef0123456789abcdef"
JWT = (
    "eyJhbGciOiJIUzI1NiJ9"
    + "."
    + "eyJzdWIiOiIxMjM0NTY3ODkwIn0"
    + "."
    + "dBjftJeZ4CVPmB92K27uhbUJU1p1r_wW1gFWFOEjXk"
)
PEM = "-----BEGIN {k}PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\nbXl0ZXN0a2V5\n-----END {k}PRIVATE KEY-----"

# (shape, text containing the secret, the secret itself)
CORPUS: list[tuple[str, str, str]] = [
    ("bearer", "retrying with Bearer abc123DEF456ghi789", "abc123DEF456ghi789"),
    ("bearer short", "sent Bearer xxx to the API", "xxx"),
    ("basic", "header Basic dXNlcjpodW50ZXIy was rejected", "dXNlcjpodW50ZXIy"),
    (
        "token scheme",
        "Token 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b",
        "9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b",
    ),
    ("jwt", f"id token {JWT} expired", JWT),
    ("url key param", "GET https://api.example/v1/geo?q=x&key=QKEY-7f3a9 failed", "QKEY-7f3a9"),
    ("url sig param", "fetch https://blob.example/f?sv=2021&sig=Zx9%2Bk3 timed out", "Zx9%2Bk3"),
    ("pem rsa", "key:\n" + PEM.format(k="RSA "), "bXl0ZXN0a2V5"),
    ("pem ec", PEM.format(k="EC "), "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC"),
    ("pem openssh", PEM.format(k="OPENSSH "), "bXl0ZXN0a2V5"),
    ("pem pkcs8", PEM.format(k=""), "bXl0ZXN0a2V5"),
    ("pem truncated", "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADAN", "MIIEvQIBADAN"),
    ("pgp", "-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQOYBF0\n-----END PGP PRIVATE KEY BLOCK-----", "lQOYBF0"),
    ("openai", "key sk-" + A36 + " leaked", "sk-" + A36),
    ("openai project", "sk-proj-" + A36, A36),
    ("anthropic", "sk-ant-api03-" + A36 + "-xyz", A36),
    ("stripe live", "sk_live_" + A36[:24], A36[:24]),
    ("stripe restricted", "rk_test_" + A36[:24], A36[:24]),
    ("stripe webhook", "whsec_" + A36, A36),
    ("github pat", "ghp_" + A36, A36),
    ("github oauth", "gho_" + A36, A36),
    ("github fine-grained", "github_pat_11ABCDEFG0_" + A36 + A36[:10], A36),
    ("gitlab", "glpat-" + A36[:20], A36[:20]),
    ("slack bot", "xoxb-1234567890-0987654321-" + A36[:24], A36[:24]),
    ("slack user", "xoxp-1234567890-abcdefabcdef", "1234567890-abcdefabcdef"),
    ("aws access key id", "AKIA" + "IOSFODNN7EXAMPLE", "IOSFODNN7EXAMPLE"),
    ("aws session key id", "id=ASIA" + "Y34FZKBOKMUTVV7A", "Y34FZKBOKMUTVV7A"),
    ("google api key", "AIza" + "SyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY", "SyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY"),
    ("google oauth", "ya29." + A36, A36),
    ("hugging face", "hf_" + A36[:34], A36[:34]),
    ("npm", "npm_" + A36, A36),
    ("pypi", "pypi-AgEIcHlwaS5vcmc" + A36 + A36, A36),
    ("sendgrid", "SG." + A36[:22] + "." + A36 + "abcdefg", A36[:22]),
    ("shopify", "shpat_" + HEX32, HEX32),
    ("digitalocean", "dop_v1_" + HEX32 + HEX32, HEX32),
    ("mailgun", "key-" + HEX32, HEX32),
    ("groq", "gsk_" + A36 + "abcdefgh", A36),
    ("replicate", "r8_" + A36, A36),
    ("slack webhook", "https://hooks.slack.com/services/T000/B000/" + A36[:24], A36[:24]),
    ("telegram bot", "bot 123456789:AA" + A36[:33], A36[:33]),
    ("redis url", "connect to redis://:s3cretpw@10.0.0.5:6379/0", "s3cretpw"),
    ("postgres url", "postgresql://app:hunter2x@db:5432/prod", "hunter2x"),
    ("amqp url", "amqp://guest:guest1pw@rabbit//", "guest1pw"),
    ("https basic url", "GET https://bob:pa55word@example.com/x failed", "pa55word"),
    ("query api_key", "GET /v1/q?city=x&api_key=abcd1234efgh&x=1", "abcd1234efgh"),
    ("query access_token", "https://api.x.com/me?access_token=EAAB1234abcd", "EAAB1234abcd"),
    ("password kv", "login failed: user=bob password=hunter22", "hunter22"),
    ("passwd yaml", "passwd: correct-horse", "correct-horse"),
    ("json client_secret", '{"client_id": "abc", "client_secret": "zyx987wvu"}', "zyx987wvu"),
    ("cookie header", "Cookie: sessionid=abcdef123456; csrftoken=qwerty", "abcdef123456"),
    ("set-cookie header", "Set-Cookie: sid=31d4d96e407aad42; HttpOnly", "31d4d96e407aad42"),
    ("x-api-key header", "X-Api-Key: 5f4dcc3b5aa765d61d8327deb882cf99", "5f4dcc3b5aa765d61d8327deb882cf99"),
    ("authorization header", "authorization: Bearer zzz999yyy888", "zzz999yyy888"),
    (
        "azure storage",
        "DefaultEndpointsProtocol=https;AccountName=x;AccountKey=Zm9vYmFyYmF6cXV4;",
        "Zm9vYmFyYmF6cXV4",
    ),
    (
        "aws secret kv",
        "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCY",
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCY",
    ),
    ("github_token env", "GITHUB_TOKEN=ghs_" + A36, A36),
]

# Keys whose values are masked whatever they look like.
SECRET_KEYS = [
    "password", "passwd", "PASSWORD", "dbPassword", "token", "access_token", "refresh_token", "github_token",
    "api_key", "apikey", "api-key", "API_KEY", "x-api-key", "X-Api-Key", "Authorization",
    "proxy-authorization", "secret", "client_secret", "cookie", "set-cookie", "Set-Cookie", "private_key",
    "credentials", "X-Auth-Token", "auth",
]  # fmt: skip

# Things that look a bit like secrets but are not, and must stay readable.
NOT_SECRETS = [
    "max_tokens=1024 temperature=0.2",
    "https://docs.example/search?keyword=redis&page=2",
    "Token expired, please log in again",
    "Basic authentication is disabled",
    "the bearer token is missing",
    "https://example.com/docs?page=2&lang=zh",
    "redis://127.0.0.1:6379/0",
    "commit 3f786850e387550fdab836ed7e6dc881de23001b",
    "call 6f1c2e0a9b7d4c3e8f5a1b2c3d4e5f60 finished in 12 ms",
    "北京 晴 25°C",
    "skip this: sk-short",
]
NOT_SECRET_KEYS = [
    "max_tokens",
    "prompt_tokens",
    "maxTokens",
    "token_type",
    "session_id",
    "tool_call_id",
    "author",
]


def test_the_corpus_has_more_than_forty_shapes() -> None:
    assert len(CORPUS) >= 40 and len({name for name, _, _ in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize(("shape", "text", "secret"), CORPUS, ids=[c[0] for c in CORPUS])
def test_secret_shapes_in_text_are_masked(shape: str, text: str, secret: str) -> None:
    out = redact_text(text)
    assert secret not in out, out
    assert MASK in out


@pytest.mark.parametrize("text", NOT_SECRETS)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact_text(text) == text


def test_url_password_keeps_scheme_user_and_host() -> None:
    assert redact_text("redis://:pw@host") == "redis://:***@host"
    assert redact_text("postgresql://app:pw1@db:5432/x") == "postgresql://app:***@db:5432/x"


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_values_under_secret_keys_are_masked_whatever_they_look_like(key: str) -> None:
    assert is_secret_key(key)
    assert redact({key: "plain", "n": 1}) == {key: MASK, "n": 1}
    assert redact({"outer": [{key: 12345}]}) == {"outer": [{key: MASK}]}


@pytest.mark.parametrize("key", NOT_SECRET_KEYS)
def test_lookalike_keys_are_kept(key: str) -> None:
    assert not is_secret_key(key)
    assert redact({key: 7}) == {key: 7}


def test_empty_secret_values_stay_visible() -> None:
    assert redact({"password": None, "token": ""}) == {"password": None, "token": ""}


def test_redact_recurses_keeps_container_types_and_never_mutates_its_input() -> None:
    value: dict[str, Any] = {
        "headers": [("Authorization", "x"), ("Accept", "json")],
        "nested": {"list": ["ok", "Bearer abc123def456", 3, True, None, 1.5], "tuple": ("a", "sk-" + A36)},
        "blob": b"password=hunter22",
        "tags": {"public"},
    }
    before = copy.deepcopy(value)
    out = redact(value)
    assert value == before
    assert out["headers"] == [("Authorization", MASK), ("Accept", "json")]
    assert out["nested"]["list"] == ["ok", "Bearer ***", 3, True, None, 1.5]
    assert out["nested"]["tuple"] == ("a", MASK)
    assert out["blob"] == b"password=***"
    assert out["tags"] == {"public"}


def test_scalars_come_back_as_they_are() -> None:
    for v in (0, 7, True, False, None, 2.5):
        assert redact(v) is v


def test_sensitive_fields_become_keyed_hashes_a_replay_can_verify_and_are_masked_elsewhere() -> None:
    args = {"card": "4111111111111111", "query": {"b": 1, "a": [1, 2]}, "city": "北京"}
    digest = keyed_hash(b"k" * 32)
    out = redact(args, sensitive_fields=["card", "query"], digest=digest)
    assert out["city"] == "北京"
    assert out["card"].startswith("hmac-sha256:") and out["card"] != hash_value("4111111111111111")
    assert verify_hash("4111111111111111", out["card"], digest)
    assert not verify_hash("4111111111111112", out["card"], digest)
    assert not verify_hash("4111111111111111", out["card"], keyed_hash(b"another deployment"))
    assert not verify_hash("4111111111111111", out["card"])  # (no key: nothing matches a keyed hash)
    assert verify_hash({"a": [1, 2], "b": 1}, out["query"], digest)  # key order does not matter
    assert verify_hash("4111", hash_value("4111"))  # a record written before keyed hashes still checks
    assert sensitive_hashes(args, ["card", "missing"], digest) == {"card": out["card"]}
    assert redact(args, ["card"])["card"] == MASK  # spans, logs, views: no hash at all
    assert hash_value([1, 2]) == hash_value((1, 2))


def test_deep_nesting_is_cut_not_crashing() -> None:
    value: Any = "sk-" + A36
    for _ in range(100):
        value = [value]
    out = redact(value)
    assert "sk-" not in json.dumps(out)


def test_the_whole_corpus_inside_one_structure_leaves_no_secret() -> None:
    args = {f"field{i}": text for i, (_, text, _) in enumerate(CORPUS)}
    args["nested"] = [{"note": text} for _, text, _ in CORPUS]
    dumped = json.dumps(redact(args), ensure_ascii=False)
    for shape, _, secret in CORPUS:
        assert secret not in dumped, shape


def test_structlog_processor_scrubs_every_event() -> None:
    buf = io.StringIO()
    log = structlog.wrap_logger(
        structlog.PrintLogger(file=buf),
        processors=[redact_processor, structlog.processors.JSONRenderer()],
    )
    for shape, text, _ in CORPUS:
        log.info(f"calling {shape}: {text}", shape=shape, detail={"text": text}, api_key="k-12345")
    log.info("boom", error=RuntimeError("401 for Bearer abcdef123456"))
    out = buf.getvalue()
    for shape, _, secret in CORPUS:
        assert secret not in out, shape
    assert "abcdef123456" not in out and "RuntimeError: 401 for Bearer ***" in out
    assert '"api_key": "***"' in out
    assert len(out.splitlines()) == len(CORPUS) + 1


def test_processor_masks_configured_fields() -> None:
    proc = RedactProcessor(sensitive_fields=["ssn"])
    out = proc(None, "info", {"event": "x", "ssn": "123-45-6789"})
    assert out["ssn"] == MASK


def test_long_text_is_clipped_and_a_secret_straddling_the_cut_is_masked_not_shown_in_part() -> None:
    key = "sk-" + A36
    text = "x" * 94 + " " + key + " " + "y" * 1000
    clipped = redact(text, max_text=100)
    assert clipped.startswith("x" * 94 + " ***") and clipped.endswith(f"…[{len(text) - 100} more characters]")
    assert "sk-" not in clipped  # the cut fell inside the key: it is masked as it would be whole
    assert redact("short", max_text=100) == "short"
    nested = redact({"a": ["z" * 300, {"b": "w" * 300}]}, max_text=10)
    assert nested == {"a": ["z" * 10 + "…[290 more characters]", {"b": "w" * 10 + "…[290 more characters]"}]}
    assert redact({"blob": b"\x00" * 50}, max_text=10) == {"blob": "<50 bytes>"}


def test_an_errors_wire_form_masks_what_its_message_quotes_from_the_caller() -> None:
    from broker.errors import InvalidArgs

    message = (
        "tool 'hello': invalid arguments: $.name: {'password': 'hunter2-secret'} is not of type 'string'"
    )
    wire = InvalidArgs(message, path="$.name", sent="Bearer " + A36).to_wire()
    assert "hunter2" not in str(wire) and A36 not in str(wire)
    assert (
        wire["message"].endswith("{'password': '***'} is not of type 'string'")
        and wire["details"]["path"] == "$.name"
    )
    huge = InvalidArgs("x" * 100_000).to_wire()["message"]  # a message quoting megabytes is cut, cheaply
    assert len(huge) < 20_000 and huge.endswith("more characters]")


@pytest.mark.parametrize(
    "text",
    [
        '{"error": "upstream said {\\"password\\":\\"hunter22x\\"}"}',  # JSON quoted inside JSON text
        'bad request: {\\"api_key\\": \\"hunter22x\\", \\"user\\": \\"bob\\"}',
        '{\\"Authorization\\":\\"hunter22x\\"}',
        "{\\\\\\\"token\\\\\\\":\\\\\\\"hunter22x\\\\\\\"}",  # quoted twice
        "password=hunter22x\\more",  # a backslash inside the value does not end it
    ],
)
def test_json_escaped_secrets_in_back_end_error_text_are_masked(text: str) -> None:
    out = redact_text(text)
    assert "hunter22x" not in out and "more" not in out and MASK in out


def test_secret_values_cover_a_secret_as_a_url_carries_it_and_everything_inside_an_object() -> None:
    from broker.logs import scrub, secret_values

    values = secret_values({"token": "AbC+dEf/GhI=secret", "password": {"x": ["inner-s3cret"]}, "q": "x"}, ["q"])
    # A back end's error quoting its request line: the value percent-encoded in the path, or form-encoded.
    for said in ("GET /echo/AbC%2BdEf%2FGhI%3Dsecret?q=x", "token=AbC%2BdEf%2FGhI%3Dsecret", "{'x': ['inner-s3cret']}"):
        assert "secret" not in scrub(said, values).replace("***", ""), said
