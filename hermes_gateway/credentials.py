"""Who is calling the HTTP API and ``/mcp``: principals bound to bearer tokens (``api.tokens``: the
sha256 hex of a token -> ``{principal, admin}``; ``api.token_principal``: who ``--token`` calls as).
A caller may not claim another principal unless its credential is *admin* (the single token, an
``admin: true`` entry, any caller of a loopback-only server without tokens); a credential that is not
admin sees and acts on its own principal's calls only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.errors import ConfigError, PermissionDenied
from broker.settings import API_KEYS

CALLER_SCOPE_KEY = "hermes.caller"  # where a request's Caller is kept in its ASGI scope
MANAGE_TOOLS = "tools:write"  # the policy grant that lets a principal register and remove tools
_HEX = re.compile(r"[0-9a-f]{64}")
_ENTRY_KEYS = {"principal", "admin"}


@dataclass(frozen=True)
class Caller:
    """A request's credential: its principal (None: the policy's default) and whether it is admin."""

    principal: str | None
    admin: bool = False

    def principal_for(self, claimed: Any) -> str | None:
        """The principal a call runs as when the caller names ``claimed`` (None: it names none)."""
        if claimed is None or claimed == "" or claimed == self.principal:
            return self.principal
        if self.admin and isinstance(claimed, str):
            return claimed
        raise PermissionDenied(
            f"permission denied: this credential is principal {self.principal!r}, it cannot act as {claimed!r}",
            principal=self.principal,
            claimed=claimed if isinstance(claimed, str) else repr(claimed),
            rule="credentials",
        )

    def sees(self, principal: Any) -> bool:
        """Whether this caller may see and act on a call that runs as ``principal`` (None: no principal)."""
        return self.admin or (self.principal is not None and principal == self.principal)

    def check_manage_tools(self, policy: Any) -> None:
        """PermissionDenied unless this caller may register and remove tools under ``policy``."""
        if self.admin:
            return
        held = {tag for tag, _ in policy.grants_of(self.principal)}
        if MANAGE_TOOLS in held or "*" in held:
            return
        who = policy.principal_of(self.principal)
        raise PermissionDenied(
            f"permission denied: principal {who!r} lacks permission {MANAGE_TOOLS} to register or remove tools",
            principal=who,
            missing=[MANAGE_TOOLS],
            rule="permissions",
        )


TRUSTED_LOCAL = Caller(None, admin=True)  # a loopback-only server without any token: as before tokens


def token_key(token: str) -> str:
    """The ``api.tokens`` key of ``token``: its sha256, hex."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class Credentials:
    """The tokens a server accepts and the caller each one is."""

    def __init__(
        self, token: str | None = None, api: Mapping[str, Any] | None = None, allowed_hosts: frozenset[str] = frozenset()
    ) -> None:
        self.allowed_hosts = allowed_hosts  # (api.allowed_hosts: what the routes taking no token answer to)
        api = api or {}
        if not isinstance(api, Mapping):
            raise ConfigError(f"config.yaml: api: expected a mapping, got {type(api).__name__}")
        unknown = set(api) - set(API_KEYS)
        if unknown:
            raise ConfigError(f"config.yaml: api: unknown key(s) {sorted(unknown)}; expected {', '.join(API_KEYS)}")
        named = api.get("token_principal")
        if named is not None and (not isinstance(named, str) or not named):
            raise ConfigError("config.yaml: api.token_principal: expected a principal name")
        self.token = token
        self.admin_caller = Caller(named, admin=True)
        tokens = api.get("tokens")
        if tokens is not None and tokens != "" and not isinstance(tokens, Mapping):
            raise ConfigError("config.yaml: api.tokens: expected a mapping of sha256 hex -> {principal: ...}")
        self.tokens = {str(key): _entry(str(key), raw) for key, raw in (tokens or {}).items()}

    @classmethod
    def from_settings(cls, settings: Any, token: str | None = None) -> Credentials:
        return cls(token, (settings.raw or {}).get("api"), settings.api.allowed_hosts)

    @property
    def required(self) -> bool:
        """Whether a request must present a token (any token is configured)."""
        return self.token is not None or bool(self.tokens)

    def caller(self, presented: str | None) -> Caller | None:
        """The caller ``presented`` identifies; None for a missing or unknown token (401)."""
        if not self.required:
            return TRUSTED_LOCAL
        if not presented:
            return None
        if self.token is not None and hmac.compare_digest(presented.encode(), self.token.encode()):
            return self.admin_caller
        return self.tokens.get(token_key(presented))


def _entry(key: str, raw: Any) -> Caller:
    where = f"config.yaml: api.tokens.{key[:12]}…"
    if not _HEX.fullmatch(key):
        raise ConfigError(f"{where}: a key is the sha256 of a token as 64 lowercase hex digits (sha256sum)")
    if isinstance(raw, str):
        raw = {"principal": raw}
    if not isinstance(raw, Mapping) or set(raw) - _ENTRY_KEYS:
        raise ConfigError(f"{where}: expected {{principal: NAME, admin: true|false}}")
    principal, admin = raw.get("principal"), raw.get("admin", False)
    if not isinstance(principal, str) or not principal:
        raise ConfigError(f"{where}.principal: expected a principal name")
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}.admin: expected true or false")
    return Caller(principal, admin=admin)
