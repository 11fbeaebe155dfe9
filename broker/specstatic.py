"""A tool spec's *static* checks, part of registration (:mod:`broker.specchecks` calls them).

Beyond keys and types, :func:`check_static` runs each executor's *static* checks, so a spec that
could never run is refused at registration rather than at its first call: an http ``endpoint`` that
is not an http(s) URL (or has a placeholder in its scheme or host), a python ``function`` that is not
``module:callable``, a ``command`` that cannot be split or names its program by placeholder, a
``body_template`` that does not parse, more than one SQL statement in a database ``query``, a grpc
``method`` that is not ``package.Service/Method``, shell or interpreter code holding a placeholder
(``sh -c "ls {{dir}}"``: :func:`code_placeholder`). The executors in ``workers/executors/`` keep the
same checks (a stored spec is not re-validated) and share the helpers defined here.

When ``input_schema`` declares ``properties``, every ``{{placeholder}}`` in a templated key
(``command``, ``env_set``, ``endpoint``/``url``, ``headers``, ``body_template``) must name one of them
(a dotted ``{{opts.unit}}`` is followed into nested ``properties`` where they are declared).

A value that starts with a ``${VAR}`` reference is taken from the worker's environment at run time
(``workers/executors/specenv.py``), so what it must look like is judged there, not here.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import yaml

from .config import ENV_VAR
from .errors import InvalidSpec
from .yamlload import load_yaml


def _fail(where: str, path: str, expected: str) -> InvalidSpec:
    return InvalidSpec(f"{where}: {path}: {expected}", path=path)


# ``{{field}}`` in a spec's templates; group 1 is the field name (a dotted path into nested arguments).
PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_.\-]*)\s*\}\}")
# Keys whose strings are filled from the arguments, per executor.
TEMPLATED_KEYS: dict[str, tuple[str, ...]] = {
    "command": ("command", "env_set"),
    "http": ("endpoint", "url", "headers", "body_template"),
}
_DOTTED = re.compile(r"[^\W\d]\w*(?:\.[^\W\d]\w*)*")
_SEND_ARGS_AS = ("query", "form", "json")
_DB_MODES = ("template", "structured")
_SQL_COMMENTS = re.compile(r"(--[^\n]*|/\*.*?\*/)", re.S)

def _from_env(value: Any) -> bool:
    """True when the text starts with a ``${VAR}`` reference: only the worker's environment can judge it."""
    return isinstance(value, str) and ENV_VAR.match(value.strip()) is not None


def http_url_problem(url: str) -> str | None:
    """What is wrong with an http executor's endpoint (None: nothing). Shared with the executor."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"expected an http(s) URL, got {url!r}"
    if PLACEHOLDER.search(parts.scheme + "://" + parts.netloc):
        return "placeholders may not appear in the scheme or host"
    return None


def split_function_ref(ref: str) -> tuple[str, str] | None:
    """``module:attr`` (or ``module.attr``) as (module, attr), or None when it is not that shape."""
    module, sep, attr = ref.strip().partition(":")
    if not sep:
        module, _, attr = ref.strip().rpartition(".")
    if not _DOTTED.fullmatch(module) or not _DOTTED.fullmatch(attr):
        return None
    return module, attr


def split_grpc_method(name: str) -> tuple[str, str] | None:
    """``package.Service/Method`` (or ``package.Service.Method``) as (service, method), or None."""
    service, sep, method = name.rpartition("/")
    if not sep:
        service, _, method = name.rpartition(".")
    if not service or not method:
        return None
    return service, method


def single_statement(sql: str) -> bool:
    """True when ``sql`` holds one statement (a ``;`` inside a string literal is fine)."""
    body = _SQL_COMMENTS.sub(" ", sql).strip().rstrip(";")
    return ";" not in re.sub(r"'(?:[^']|'')*'", "''", body)


def first_sql_keyword(sql: str) -> str:
    """The statement's first keyword, lower case (comments and an opening parenthesis skipped)."""
    stripped = _SQL_COMMENTS.sub(" ", sql).strip().lstrip("(").strip()
    return stripped.split(None, 1)[0].lower() if stripped else ""


# Programs that run code given on their command line, and the options that give it (a word of single-letter
# options like bash's ``-ec`` holds the letter). A placeholder in that code would let a value be code.
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "fish", "csh", "tcsh"})
_CODE_OPTIONS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # program (basename, version suffix dropped) -> (short option letters, long options)
    **{sh: (frozenset("c"), frozenset({"--command"})) for sh in _SHELLS},
    "python": (frozenset("c"), frozenset()),
    "pypy": (frozenset("c"), frozenset()),
    "perl": (frozenset("eE"), frozenset()),
    "ruby": (frozenset("e"), frozenset()),
    "node": (frozenset("ep"), frozenset({"--eval", "--print"})),
    "deno": (frozenset(), frozenset({"eval"})),
    "php": (frozenset("r"), frozenset()),
    "lua": (frozenset("e"), frozenset()),
    "luajit": (frozenset("e"), frozenset()),
    "tclsh": (frozenset(), frozenset()),
    "osascript": (frozenset("e"), frozenset()),
    "pwsh": (frozenset(), frozenset({"-c", "-command", "-encodedcommand", "-ec"})),
    "powershell": (frozenset(), frozenset({"-c", "-command", "-encodedcommand", "-ec"})),
}
# Programs that run the program named after them (``env sh {{x}}``).
_WRAPPERS = frozenset({"env", "busybox", "nice", "nohup", "setsid", "stdbuf", "sudo", "doas", "time", "exec"})
_VERSION = re.compile(r"[\d.]+$")


def _program(part: str) -> str:
    name = part.rsplit("/", 1)[-1].lower().removesuffix(".exe")
    return _VERSION.sub("", name) if not name.startswith(("sh", "ksh")) else name


def code_placeholder(parts: list[str]) -> str | None:
    """What is wrong when a command hands code with a placeholder in it to a shell or interpreter
    (``sh -c "ls {{dir}}"``, ``python3 -c ...``, ``bash -ec``, also behind ``env``/``timeout``/``busybox``)
    or lets a value name the script it runs (``sh {{script}}``); None when it does not. Values after
    the code stay arguments (``sh -c 'cat "$1"' sh {{file}}`` is fine)."""
    for i, part in enumerate(parts):
        program = _program(part)
        options = _CODE_OPTIONS.get(program)
        if options is None or (i > 0 and part.startswith("-")):
            continue
        letters, longs = options
        for opt in parts[i + 1 :]:
            name, eq, inline = opt.partition("=")
            short = opt[1:] if opt.startswith("-") and not opt.startswith("--") else ""
            if name.lower() in longs or (short.isalpha() and letters & set(short)):
                j = parts.index(opt, i + 1)
                code = inline if eq and name.lower() in longs else (parts[j + 1] if j + 1 < len(parts) else "")
                if PLACEHOLDER.search(code) or PLACEHOLDER.search(opt):
                    return (
                        f"{program} {name} runs its next argument as code: a placeholder there would let a "
                        "value be code; pass values as arguments after the code (sh -c 'cat \"$1\"' sh {{file}})"
                    )
                return None
            if not opt.startswith("-"):
                named = i == 0 or _program(parts[i - 1]) in _WRAPPERS  # the program itself, not an argument
                if named and PLACEHOLDER.search(opt):
                    return f"{program} {opt}: a placeholder would let a value name the script {program} runs"
                return None  # a script file: what follows are its arguments
        return None
    return None


def check_static(where: str, executor: str, data: Mapping[str, Any]) -> None:
    """Each executor's checks that need no call: a spec failing them could never run."""
    check = _STATIC.get(executor)
    if check is not None:
        check(where, data)


def _static_http(where: str, data: Mapping[str, Any]) -> None:
    for key in ("endpoint", "url"):
        url = data.get(key)
        if url in (None, "") or _from_env(url):
            continue
        if not isinstance(url, str):
            raise _fail(where, key, f"expected an http(s) URL, got {type(url).__name__} {url!r}")
        problem = http_url_problem(url.strip())
        if problem:
            raise _fail(where, key, problem)
    mode = data.get("send_args_as")
    if mode is not None and mode not in _SEND_ARGS_AS:
        raise _fail(where, "send_args_as", f"expected one of {', '.join(_SEND_ARGS_AS)}, got {mode!r}")
    headers = data.get("headers")
    if headers is not None:
        if not isinstance(headers, dict):
            raise _fail(where, "headers", "expected a mapping of header name to value")
        for name, value in headers.items():
            if PLACEHOLDER.search(str(name)):
                raise _fail(where, f"headers.{name}", "placeholders may not appear in header names")
            if isinstance(value, dict | list):
                raise _fail(where, f"headers.{name}", "expected a text value")
    template = data.get("body_template")
    if isinstance(template, str):
        try:
            parsed = load_yaml(template)
        except yaml.YAMLError as e:
            raise _fail(where, "body_template", f"template is not valid YAML/JSON: {e}") from e
        for path, key in _keys(parsed, "body_template"):
            if PLACEHOLDER.search(key):
                raise _fail(where, path, "template keys may not contain placeholders")


def _static_command(where: str, data: Mapping[str, Any]) -> None:
    template = data.get("command")
    if isinstance(template, str):
        try:
            parts = shlex.split(template)
        except ValueError as e:
            raise _fail(where, "command", f"cannot split {template!r}: {e}") from e
    elif isinstance(template, list):
        for i, part in enumerate(template):
            if isinstance(part, bool) or not isinstance(part, str | int | float):
                raise _fail(where, f"command[{i}]", f"expected a string, got {type(part).__name__}")
        parts = [str(p) for p in template]
    else:
        raise _fail(where, "command", "expected a string or a list of strings")
    if not parts:
        raise _fail(where, "command", "is empty")
    if PLACEHOLDER.search(parts[0]):
        raise _fail(where, "command", "the program (argv[0]) may not contain a placeholder")
    problem = code_placeholder(parts)
    if problem:
        raise _fail(where, "command", problem)
    separator = data.get("args_separator")
    if separator is not None and not isinstance(separator, bool):
        raise _fail(where, "args_separator", f"expected true or false, got {separator!r}")
    env_set = data.get("env_set")
    if env_set is not None and not isinstance(env_set, dict):
        raise _fail(where, "env_set", "expected a mapping {NAME: value}")
    names = data.get("env")
    if names is not None and not (
        isinstance(names, str) or (isinstance(names, list) and all(isinstance(n, str) for n in names))
    ):
        raise _fail(where, "env", "expected a variable name or a list of names")


def _static_python(where: str, data: Mapping[str, Any]) -> None:
    ref = data.get("function")
    if _from_env(ref):
        return
    if not isinstance(ref, str) or split_function_ref(ref) is None:
        raise _fail(where, "function", f"expected 'package.module:callable', got {ref!r}")


def _static_database(where: str, data: Mapping[str, Any]) -> None:
    dsn = data.get("dsn")
    if dsn is not None and not isinstance(dsn, str):
        raise _fail(where, "dsn", f"expected a database URL, got {type(dsn).__name__}")
    mode = data.get("mode")
    if mode is not None and mode not in _DB_MODES:
        raise _fail(where, "mode", f"expected one of {', '.join(_DB_MODES)}, got {mode!r}")
    if mode == "structured":
        tables = data.get("tables")
        if not isinstance(tables, dict):
            raise _fail(where, "tables", "expected a mapping {table: [allowed columns]}")
        for table, columns in tables.items():
            if columns is not None and not (
                isinstance(columns, list) and all(isinstance(c, str) for c in columns)
            ):
                raise _fail(where, f"tables.{table}", "expected a list of column names")
        return
    query = data.get("query")
    if query is None:
        return
    if not isinstance(query, str) or not query.strip():
        raise _fail(where, "query", "expected an SQL string")
    if not single_statement(query):
        raise _fail(where, "query", "one statement only")


def _static_grpc(where: str, data: Mapping[str, Any]) -> None:
    method = data.get("method")
    if not _from_env(method) and (not isinstance(method, str) or split_grpc_method(method) is None):
        raise _fail(where, "method", f"expected 'package.Service/Method', got {method!r}")
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _fail(where, "metadata", "expected a mapping of metadata key to value")


_STATIC: dict[str, Any] = {
    "http": _static_http,
    "command": _static_command,
    "python": _static_python,
    "database": _static_database,
    "grpc": _static_grpc,
}


# -- placeholders name declared fields ---------------------------------------------------------------


def check_placeholders(where: str, executor: str, data: Mapping[str, Any], schema: Mapping[str, Any]) -> None:
    """With declared ``properties``, each ``{{name}}`` in a templated key must name one of them."""
    props = schema.get("properties")
    if not isinstance(props, dict) or not props or schema.get("patternProperties"):
        return
    for key in TEMPLATED_KEYS.get(executor, ()):
        for path, text in _strings(data.get(key), key):
            for name in PLACEHOLDER.findall(text):
                if not declared(schema, name):
                    raise _fail(
                        where,
                        path,
                        f"placeholder {{{{{name}}}}} names no property of input_schema "
                        f"(declared: {', '.join(sorted(map(str, props)))})",
                    )


def declared(schema: Mapping[str, Any], name: str) -> bool:
    """True when ``name`` (maybe dotted) is declared, or names a level that declares nothing."""
    props = schema.get("properties")
    if isinstance(props, dict) and name in props:
        return True
    node: Any = schema
    for part in name.split("."):
        props = node.get("properties") if isinstance(node, dict) else None
        if not isinstance(props, dict) or not props:
            return True  # nothing declared at this level: nothing to judge against
        if part not in props:
            return False
        node = props[part]
    return True


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")


def _keys(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}.{k}", str(k)
            yield from _keys(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _keys(v, f"{path}[{i}]")
