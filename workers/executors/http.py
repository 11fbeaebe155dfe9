"""The ``http`` executor: call an HTTP endpoint with the arguments, behind the SSRF guard (:mod:`netguard`).

``{{field}}`` is percent-encoded into the endpoint's path and query only; other arguments go to the query
string or a form body (``send_args_as`` overrides); ``body_template`` is parsed FIRST, then filled with
typed values and sent as JSON. With a body to send and no ``method``, the method is POST, else GET. An optional field left out drops what is just its placeholder
(``broker/placeholders.py``). Registration refuses what the run would, and the run checks again. The
result is the JSON body, else text; status >= 400 is an ExecutorError with ``details.status``.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

import yaml

from broker.errors import (
    CallCancelled,
    ExecutorError,
    HermesError,
    InvalidArgs,
    InvalidSpec,
    OutputTooLarge,
    ToolTimeout,
)
from broker.placeholders import (
    OMIT,
    check_declared,
    fill,
    fill_structure,
    has,
    masked_load,
    names,
    render,
    sole,
    value_of,
)
from broker.toolspec import ToolSpec
from workers.args import load_yaml_text
from workers.providers.backoff import pause_seconds

from . import ACCEPT_ENCODING, DEFAULT_MAX_OUTPUT, ExecContext, Inflater, PerProcess, from_env, require

if TYPE_CHECKING:  # httpx and the guard are imported where a call runs, not where a spec registers
    import httpx

    from .netguard import GuardPolicy

DEFAULT_MAX_REDIRECTS = 5
_BODY_METHODS = {"POST", "PUT", "PATCH"}
_SEND_ARGS_AS = ("query", "form", "json")
_EXCERPT = 500


def url_problem(url: str) -> str | None:
    """What is wrong with an endpoint (None: nothing)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"expected an http(s) URL, got {url!r}"
    if has(parts.scheme + "://" + parts.netloc):
        return "placeholders may not appear in the scheme or host"
    return None


def parse_body(template: str, where: str) -> Any:
    """A ``body_template`` text as a structure, its placeholders kept as leaf strings (never keys)."""
    try:
        parsed = masked_load(template, load_yaml_text)
    except yaml.YAMLError as e:
        raise InvalidSpec.at(where, "body_template", f"template is not valid YAML/JSON: {e}") from e
    for path, key in _keys(parsed, "body_template"):
        if has(key):
            raise InvalidSpec.at(where, path, "template keys may not contain placeholders")
    return parsed


def _keys(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}.{k}", str(k)
            yield from _keys(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _keys(v, f"{path}[{i}]")


class HttpExecutor:
    """One httpx client per guard policy (usually one), shared by all worker threads."""

    keys = frozenset(
        {"endpoint", "url", "method", "headers", "send_args_as", "body_template"}
        | {"allow_hosts", "allow_networks", "max_output", "max_redirects", "verify"}
    )

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self._clients: PerProcess[tuple[Any, ...], httpx.Client] = PerProcess()  # by (guard policy, verify)

    @staticmethod
    def check(where: str, data: Mapping[str, Any]) -> None:
        require(where, "http", data, ("endpoint", "url"), "the URL to call, e.g. http://host/path/{{id}}")
        for key in ("endpoint", "url"):
            url = data.get(key)
            if url in (None, "") or from_env(url):
                continue  # a ${VAR} is judged on the worker, once filled in
            if not isinstance(url, str):
                raise InvalidSpec.at(where, key, f"expected an http(s) URL, got {type(url).__name__} {url!r}")
            if problem := url_problem(url.strip()):
                raise InvalidSpec.at(where, key, problem)
        mode = data.get("send_args_as")
        if mode is not None and mode not in _SEND_ARGS_AS:
            raise InvalidSpec.at(where, "send_args_as", f"expected one of {', '.join(_SEND_ARGS_AS)}, got {mode!r}")
        headers = data.get("headers")
        if headers is not None and not isinstance(headers, dict):
            raise InvalidSpec.at(where, "headers", "expected a mapping of header name to value")
        for name, value in (headers or {}).items():
            if has(str(name)):
                raise InvalidSpec.at(where, f"headers.{name}", "placeholders may not appear in header names")
            if isinstance(value, dict | list):
                raise InvalidSpec.at(where, f"headers.{name}", "expected a text value")
        if isinstance(data.get("body_template"), str):
            parse_body(data["body_template"], where)
        check_declared(where, data, ("endpoint", "url", "headers", "body_template"))

    def _policy(self, config: dict[str, Any]) -> GuardPolicy:
        from .netguard import GuardPolicy

        hosts = [*self.settings.get("allow_hosts", ()), *config.get("allow_hosts", ())]
        nets = [*self.settings.get("allow_networks", ()), *config.get("allow_networks", ())]
        enabled = self.settings.get("ssrf_guard", True) is not False
        return GuardPolicy.build(enabled, hosts, nets)

    def client(self, policy: GuardPolicy, verify: bool) -> httpx.Client:
        return self._clients.get((policy, verify), lambda: _guarded_client(policy, verify))

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any:
        import httpx

        from .netguard import current_call

        config = {**self.settings, **spec.config}
        where = f"tool {spec.name!r}"
        request_kw = build_request(config, args, where, spec.input_schema)
        headers = request_kw.pop("headers")
        headers.update(ctx.trace_headers())
        client = self.client(self._policy(config), bool(config.get("verify", True)))
        max_output = int(config.get("max_output", DEFAULT_MAX_OUTPUT))
        max_redirects = int(config.get("max_redirects", DEFAULT_MAX_REDIRECTS))
        secret_headers = {str(k).lower() for k in (config.get("headers") or {})}
        ctx.check()
        # The host and port only: a URL's user:password@ never goes into an event.
        ctx.progress(
            f"calling {request_kw['method']} {urlsplit(request_kw['url']).netloc.rpartition('@')[2]}"
        )
        token = current_call.set(ctx)
        try:
            request = client.build_request(headers=headers, **request_kw)
            origin = request.url.copy_with(path="/", query=None, fragment=None)
            for hop in range(max_redirects + 1):
                ctx.check()
                request.extensions["timeout"] = httpx.Timeout(ctx.remaining()).as_dict()
                response = client.send(request, stream=True)
                try:
                    if response.next_request is None:
                        return _read_result(response, ctx, max_output, where)
                    if hop < max_redirects:
                        request = _next_hop(response.next_request, origin, secret_headers, where)
                finally:
                    response.close()
            raise ExecutorError(f"{where}: more than {max_redirects} redirects", status=response.status_code)
        except httpx.TimeoutException as e:
            raise ToolTimeout(f"{where}: timed out after {ctx.timeout:g}s ({type(e).__name__})") from e
        except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as e:
            if ctx.cancelled.is_set():
                raise CallCancelled(f"call {ctx.call_id} was cancelled") from e
            raise ExecutorError(f"{where}: {type(e).__name__}: {e}") from e
        except HermesError:
            raise
        except Exception as e:  # noqa: BLE001 - a surprise in the HTTP stack fails the call, not the worker
            raise ExecutorError(f"{where}: {type(e).__name__}: {e}") from e
        finally:
            current_call.reset(token)

    def close(self) -> None:
        self._clients.close_all()


def _guarded_client(policy: GuardPolicy, verify: bool) -> httpx.Client:
    import httpx

    from .netguard import GuardedTransport

    return httpx.Client(
        transport=GuardedTransport(policy, verify), follow_redirects=False, trust_env=False,
        headers={"Accept-Encoding": ACCEPT_ENCODING},
    )


def build_request(
    config: dict[str, Any], args: dict[str, Any], where: str, schema: Any = None
) -> dict[str, Any]:
    """Method, URL, headers and body for one call; ``schema`` tells which missing fields are optional."""
    # Without a method: POST when there is a body to send (a body_template, or args sent as json/form), else GET.
    bodied = config.get("body_template") is not None or config.get("send_args_as") in ("json", "form")
    method = str(config.get("method") or ("POST" if bodied else "GET")).upper()
    endpoint = config.get("endpoint") or config.get("url")
    if not isinstance(endpoint, str) or not endpoint:
        raise InvalidSpec.at(where, "endpoint", "expected a URL")
    if problem := url_problem(endpoint):
        raise InvalidSpec.at(where, "endpoint", problem)
    parts = urlsplit(endpoint)
    used = set(names(parts.path) + names(parts.query))
    path = fill(parts.path, args, where, encode=lambda v: _path_value(v, where), schema=schema)
    query = _fill_query(parts.query, args, where, schema)
    url = urlunsplit((parts.scheme, parts.netloc, path, query, ""))
    headers: dict[str, str] = {}
    for name, value in (config.get("headers") or {}).items():
        if has(str(name)):
            raise InvalidSpec.at(where, f"headers.{name}", "placeholders may not appear in header names")
        text = str(value)
        used.update(names(text))
        if _left_out(text, args, where, schema):
            continue
        filled = fill(text, args, where, schema=schema)
        if any(c in filled for c in "\r\n\x00"):
            raise InvalidArgs(f"{where}: header {name}: value may not contain CR, LF or NUL")
        headers[str(name)] = filled
    out: dict[str, Any] = {"method": method, "url": url, "headers": headers}
    if (template := config.get("body_template")) is not None:
        structure = parse_body(template, where) if isinstance(template, str) else template
        body = fill_structure(structure, args, where, schema)
        if body is not OMIT:  # a template that is only an optional field left out: no body
            out["json"] = body
        return out
    rest = {k: v for k, v in args.items() if k not in used and v is not None}
    mode = config.get("send_args_as") or ("form" if method in _BODY_METHODS else "query")
    if mode == "json":
        out["json"] = rest
    elif mode == "form":
        out["data"] = _flat(rest)
    elif mode == "query":
        # httpx replaces (does not extend) a URL's query when given params: merge them ourselves.
        pairs = parse_qsl(query, keep_blank_values=True)
        pairs += [(k, v) for k, values in _flat(rest).items() for v in values]
        out["url"] = urlunsplit((parts.scheme, parts.netloc, path, "", ""))
        out["params"] = pairs
    else:
        raise InvalidSpec(f"{where}: send_args_as: expected query, form or json, got {mode!r}")
    return out


def _left_out(text: str, args: dict[str, Any], where: str, schema: Any) -> bool:
    """True when ``text`` is exactly one placeholder of an optional field the caller left out."""
    field = sole(text)
    return field is not None and value_of(args, field, where, schema=schema) is OMIT


def _fill_query(query: str, args: dict[str, Any], where: str, schema: Any) -> str:
    """Fill the query pair by pair; ``k={{field}}`` of a left-out optional field goes."""
    if not has(query):
        return query
    pieces = []
    for piece in query.split("&"):
        _, eq, value = piece.partition("=")
        if eq and _left_out(value, args, where, schema):
            continue
        pieces.append(fill(piece, args, where, encode=lambda v: quote(v, safe=""), schema=schema))
    return "&".join(pieces)


def _path_value(value: str, where: str) -> str:
    """Percent-encode a path value; ``.`` and ``..`` are refused (clients and servers resolve them)."""
    if value in (".", ".."):
        raise InvalidArgs(f"{where}: {value!r} is not allowed as a URL path value")
    return quote(value, safe="")


def _flat(args: dict[str, Any]) -> dict[str, list[str]]:
    """Flatten to form/query fields: lists repeat the key, mappings travel as JSON text."""
    return {
        key: [_scalar(item) for item in (value if isinstance(value, list) else [value])]
        for key, value in args.items()
    }


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return render(value)


def _next_hop(
    request: httpx.Request, origin: httpx.URL, secret_headers: set[str], where: str
) -> httpx.Request:
    """The redirect target as httpx built it, minus the spec's own headers when it leaves the origin."""
    if request.url.scheme not in ("http", "https"):
        raise ExecutorError(f"{where}: redirect to unsupported scheme {request.url.scheme!r}")
    if request.url.copy_with(path="/", query=None, fragment=None) != origin:
        for name in secret_headers:
            request.headers.pop(name, None)
    return request


def _read_result(response: httpx.Response, ctx: ExecContext, max_output: int, where: str) -> Any:
    """Stream the body up to the cap, then decode it; errors carry the status and an excerpt."""
    ctx.status_code = response.status_code
    declared = response.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_output and response.status_code < 400:
        raise OutputTooLarge(
            f"{where}: response of {declared} bytes passes the cap of {max_output}", limit=max_output
        )
    body = bytearray()
    inflater = Inflater(response.headers.get("content-encoding", ""), max_output + 1, where)
    for chunk in (piece for raw in itertools.chain(response.iter_raw(), [b""]) for piece in inflater.pieces(raw)):
        body += chunk
        if len(body) > max_output:
            if response.status_code >= 400:
                break
            raise OutputTooLarge(f"{where}: response passed the cap of {max_output} bytes", limit=max_output)
        if ctx.cancelled.is_set():
            raise CallCancelled(f"call {ctx.call_id} was cancelled")
        if time.monotonic() >= ctx.deadline:
            raise ToolTimeout(f"{where}: timed out after {ctx.timeout:g}s")
    text = bytes(body).decode(response.encoding or "utf-8", errors="replace")
    status = response.status_code
    if status >= 400:
        excerpt = text[:_EXCERPT]
        retryable = status in (408, 429) or status >= 500
        err = ExecutorError(
            f"{where}: HTTP {status} {response.reason_phrase}" + (f": {excerpt}" if excerpt else ""),
            status=status,
            body=excerpt,
            retryable=retryable,
        )
        if status in (429, 503) and (wait := pause_seconds(response.headers)) is not None:
            err.details["retry_after"] = wait  # (a rate-limited tool's key is paused that long)
        err.retryable = retryable
        raise err
    ctx.progress(f"HTTP {status}, {len(body)} bytes")
    ctype = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype == "application/json" or ctype.endswith("+json"):
        try:
            return json.loads(text) if text.strip() else None
        except ValueError as e:
            raise ExecutorError(f"{where}: response claims JSON but is not: {e}", status=status) from e
    return text

