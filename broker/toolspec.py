"""The tool spec: what a tool is, as written in YAML and stored in the directory."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .errors import InvalidSpec

# The keys every spec may have, whatever its executor; the rest is the executor's own configuration.
COMMON_KEYS = frozenset(
    {"name", "description", "executor", "input_schema", "output_schema", "timeout", "permissions"}
    | {"concurrency", "queue_size", "retry", "breaker", "sensitive", "version"}
)
# Keys routing reads (also kept in ``config``): every spec may carry them too.
ROUTING_KEYS = frozenset({"queue", "queue_partitions", "rate_limit"})

DEFAULT_TIMEOUT = 30.0
# OpenAI-compatible and Anthropic APIs refuse other function names; it also keeps a name safe as a file name,
# and, not starting with "-", as a command-line argument (a tool named "--help" or "-" reads as an option).
TOOL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")


@dataclass(frozen=True)
class ToolSpec:
    """A registered tool. ``config`` holds the executor's own keys (command, endpoint, ...)."""

    name: str
    executor: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    output_schema: dict[str, Any] | None = None
    timeout: float = DEFAULT_TIMEOUT
    permissions: tuple[str, ...] | None = None
    concurrency: int | None = None
    queue_size: int | None = None
    retry: dict[str, Any] | None = None
    breaker: dict[str, Any] | None = None
    sensitive: tuple[str, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any) -> ToolSpec:
        """Validate what every spec has (name, schemas, timeout, retry, breaker...); errors name the field
        path. The executor's own keys are its own to check (``workers.specs.check_spec`` runs both)."""
        return cls._build(data, strict=True)

    @classmethod
    def from_stored(cls, data: Any) -> ToolSpec:
        """A spec read back from the directory: checked at registration, so only rebuilt here."""
        return cls._build(data, strict=False)

    @classmethod
    def _build(cls, data: Any, strict: bool) -> ToolSpec:
        if not isinstance(data, dict):
            raise InvalidSpec(f"tool spec: expected a mapping, got {type(data).__name__}")
        name = data.get("name")
        if not isinstance(name, str) or not name.strip():
            raise InvalidSpec("tool spec.name: expected a non-empty string", path="name")
        if strict and not TOOL_NAME.fullmatch(name):
            raise InvalidSpec(
                f"tool spec.name: expected 1-64 letters, digits, '_' or '-' (what model APIs accept as a "
                f"function name), not starting with '-', got {name!r}",
                path="name",
            )
        where = f"tool {name!r}"
        executor = data.get("executor")
        if not isinstance(executor, str) or not executor:  # (which names exist is checked at registration)
            raise InvalidSpec.at(where, "executor", f"expected an executor's name, got {executor!r}")
        schema = data.get("input_schema", {"type": "object"})
        out_schema = data.get("output_schema")
        schemas = {"input_schema": schema, "output_schema": {} if out_schema is None else out_schema}
        for key, value in schemas.items():
            if not isinstance(value, dict):
                raise InvalidSpec.at(where, key, "expected a mapping (JSON Schema)")
        timeout = data.get("timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise InvalidSpec.at(where, "timeout", f"expected a positive number of seconds, got {timeout!r}")
        perms = data.get("permissions")
        if perms is not None:
            if isinstance(perms, str):
                perms = [perms]
            if not isinstance(perms, list) or not all(isinstance(p, str) for p in perms):
                raise InvalidSpec.at(where, "permissions", "expected a list of tag strings")
            perms = tuple(perms)
        for key in ("concurrency", "queue_size"):
            val = data.get(key)
            if val is not None and (
                isinstance(val, bool) or not isinstance(val, int) or val < (1 if key == "concurrency" else 0)
            ):
                raise InvalidSpec.at(where, key, f"expected a positive integer, got {val!r}")
        parts = data.get("queue_partitions")
        if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= 1024):
            expected = f"expected an integer from 1 to 1024, got {parts!r}"
            raise InvalidSpec.at(where, "queue_partitions", expected)
        for key in ("retry", "breaker"):
            val = data.get(key)
            if val is not None and not isinstance(val, dict):
                raise InvalidSpec.at(where, key, "expected a mapping")
        sensitive = data.get("sensitive") or ()
        if not isinstance(sensitive, list | tuple) or not all(isinstance(s, str) for s in sensitive):
            raise InvalidSpec.at(where, "sensitive", "expected a list of argument names")
        description = data.get("description", "")
        if not isinstance(description, str):
            raise InvalidSpec.at(where, "description", "expected a string")
        config = {k: v for k, v in data.items() if k not in COMMON_KEYS}
        if strict:
            from .specchecks import check_strict  # jsonschema: only where a spec is registered

            check_strict(where, data, schema, out_schema)
        if executor == "mcp" and "server" in config and "mcp" not in config:
            # `server: name` is shorthand for `mcp: {server: name}`, the form the executor reads.
            config["mcp"] = {"server": config.pop("server")}
        return cls(
            name=name,
            executor=executor,
            description=description,
            input_schema=schema,
            output_schema=out_schema,
            timeout=float(timeout),
            permissions=perms,
            concurrency=data.get("concurrency"),
            queue_size=data.get("queue_size"),
            retry=data.get("retry"),
            breaker=data.get("breaker"),
            sensitive=tuple(sensitive),
            config=config,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "executor": self.executor,
            "description": self.description,
            "input_schema": self.input_schema,
            "timeout": self.timeout,
        }
        for key in ("output_schema", "concurrency", "queue_size", "retry", "breaker"):
            val = getattr(self, key)
            if val is not None:
                out[key] = val
        if self.permissions is not None:
            out["permissions"] = list(self.permissions)
        if self.sensitive:
            out["sensitive"] = list(self.sensitive)
        out.update(self.config)
        return out

    def digest(self) -> str:
        """A content hash: re-registering an identical spec is a no-op."""
        packed = msgpack.packb(_canonical(self.to_dict()), use_bin_type=True)
        return hashlib.sha256(packed).hexdigest()[:16]


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        # Keys of one type in their own order (the digests stored so far); a YAML mapping may mix types.
        return [[k, _canonical(value[k])] for k in sorted(value, key=lambda k: (type(k).__name__, k))]
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value
