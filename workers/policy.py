"""Policy: which principal may call which tool, judged on the effective (post-middleware) args.

Configured under ``policy:`` in ``config.yaml`` (docs/security.md). Rules are tried in a fixed order and
the first refusal wins: ``deny_tools``, the principal's ``deny_tools``, ``allow_tools``, the principal's
``allow_tools``, the permission tags (mode), then the argument rules (``args.path_prefixes``, keyed by tool
name or glob, whose paths ``workers/pathargs.py`` finds). A principal's grants are the union of every
``principals`` entry whose key (a glob; ``"*"`` matches everyone, the anonymous principal included) matches
its name; ``"*"`` as a grant holds every tag.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from broker.codec import pack, unpack
from broker.errors import ConfigError, DecodeError, PermissionDenied
from broker.toolspec import ToolSpec
from workers import pathargs

PERMISSIVE = "permissive"
STRICT = "strict"
MODES = (PERMISSIVE, STRICT)
# The seed's names for the two modes ("whitelist" lets undeclared tools run, "blacklist" refuses them).
MODE_ALIASES = {"whitelist": PERMISSIVE, "白名单": PERMISSIVE, "blacklist": STRICT, "黑名单": STRICT, "严格模式": STRICT}
ANONYMOUS = "anonymous"
ALL_TAGS = "*"
POLICY_VERSION = 1
_TOP_KEYS = {"mode", "default_principal", "deny_tools", "allow_tools", "principals", "args"}
_PRINCIPAL_KEYS = {"grants", "deny_tools", "allow_tools", "daily_tokens"}
_ARG_RULES = {"path_prefixes"}


@dataclass(frozen=True)
class Decision:
    """The verdict on one call: allowed or not, the rule that decided, the tags still missing."""

    allowed: bool
    rule: str
    missing: tuple[str, ...] = ()
    message: str = ""
    principal: str = ""
    tool: str = ""

    def __bool__(self) -> bool:
        return self.allowed


@dataclass(frozen=True)
class PrincipalRule:
    """One ``principals`` entry; ``pattern`` is a glob over principal names."""

    pattern: str
    grants: tuple[str, ...] = ()
    deny_tools: tuple[str, ...] = ()
    allow_tools: tuple[str, ...] | None = None
    daily_tokens: int | None = None  # LLM tokens the principal may use per UTC day (None: no budget)

    @property
    def source(self) -> str:
        return f"principals.{self.pattern}"


@dataclass(frozen=True)
class PathRule:
    """Allowed prefixes for a tool's path-like args: every one ``workers/pathargs.py`` finds when ``args``
    is None, else exactly the arguments named (dotted names reach nested ones)."""

    tool: str
    allow: tuple[str, ...]
    args: tuple[str, ...] | None = None

    def judged(self, spec: ToolSpec, args: Mapping[str, Any]) -> list[tuple[str, Any]]:
        """``(where, value)`` of every value this rule judges in the call's effective args."""
        if self.args is not None:
            return pathargs.named(self.args, args)
        return pathargs.every_path(spec, args)


@dataclass(frozen=True)
class Policy:
    """Plain data: build with ``from_dict``/``from_settings``, ship with ``encode``/``decode``."""

    mode: str = PERMISSIVE
    default_principal: str = ANONYMOUS
    deny_tools: tuple[str, ...] = ()
    allow_tools: tuple[str, ...] | None = None
    principals: tuple[PrincipalRule, ...] = ()
    path_rules: tuple[PathRule, ...] = ()
    _grant_cache: dict[str, tuple[tuple[str, str], ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def from_settings(cls, policy_settings: Mapping[str, Any] | None) -> Policy:
        """The policy of ``settings.policy`` (an empty mapping is the permissive default)."""
        return cls.from_dict(policy_settings or {})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Validate a ``policy:`` mapping; typos are errors, because a silently ignored rule is a hole."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"policy: expected a mapping, got {type(data).__name__}")
        _known_keys("policy", set(data) - {"version"}, _TOP_KEYS)
        mode = data.get("mode", PERMISSIVE)
        mode = MODE_ALIASES.get(mode, mode) if isinstance(mode, str) else mode
        if mode not in MODES:
            raise ConfigError(
                f"policy.mode: expected one of {MODES} (or the seed's whitelist = permissive, blacklist = "
                f"strict), got {mode!r}"
            )
        default_principal = data.get("default_principal") or ANONYMOUS
        if not isinstance(default_principal, str):
            raise ConfigError("policy.default_principal: expected a string")
        principals_raw = data.get("principals") or {}
        if not isinstance(principals_raw, Mapping):
            raise ConfigError("policy.principals: expected a mapping of principal -> {grants, deny_tools}")
        principals = tuple(_principal(str(k), v) for k, v in principals_raw.items())
        args_raw = data.get("args") or {}
        if not isinstance(args_raw, Mapping) or set(args_raw) - _ARG_RULES:
            raise ConfigError(f"policy.args: expected a mapping with some of {sorted(_ARG_RULES)}")
        prefixes = args_raw.get("path_prefixes") or {}
        if not isinstance(prefixes, Mapping):
            raise ConfigError("policy.args.path_prefixes: expected a mapping of tool -> prefixes")
        return cls(
            mode=mode,
            default_principal=default_principal,
            deny_tools=_names(data.get("deny_tools"), "policy.deny_tools") or (),
            allow_tools=_names(data.get("allow_tools"), "policy.allow_tools"),
            principals=principals,
            path_rules=tuple(_path_rule(str(t), v) for t, v in prefixes.items()),
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``policy:`` mapping this policy was built from (normalised)."""
        out: dict[str, Any] = {
            "version": POLICY_VERSION,
            "mode": self.mode,
            "default_principal": self.default_principal,
            "deny_tools": list(self.deny_tools),
            "principals": {},
        }
        if self.allow_tools is not None:
            out["allow_tools"] = list(self.allow_tools)
        for p in self.principals:
            entry: dict[str, Any] = {"grants": list(p.grants), "deny_tools": list(p.deny_tools)}
            if p.allow_tools is not None:
                entry["allow_tools"] = list(p.allow_tools)
            if p.daily_tokens is not None:
                entry["daily_tokens"] = p.daily_tokens
            out["principals"][p.pattern] = entry
        if self.path_rules:
            out["args"] = {
                "path_prefixes": {
                    r.tool: {"allow": list(r.allow), **({"args": list(r.args)} if r.args is not None else {})}
                    for r in self.path_rules
                }
            }
        return out

    def encode(self) -> bytes:
        """msgpack, for storing in Redis and pushing to every worker."""
        return pack(self.to_dict())

    @classmethod
    def decode(cls, data: bytes) -> Policy:
        raw = unpack(data)
        if not isinstance(raw, dict) or raw.get("version") != POLICY_VERSION:
            raise DecodeError(f"not a version {POLICY_VERSION} policy")
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise DecodeError(f"stored policy does not validate: {e}") from e

    def digest(self) -> str:
        """Content hash: workers compare it to skip reloading an unchanged policy."""
        return hashlib.sha256(self.encode()).hexdigest()[:16]

    def principal_of(self, principal: str | None) -> str:
        """The principal a call acts as: its own, or ``default_principal`` when it carries none."""
        return principal or self.default_principal

    def grants_of(self, principal: str | None) -> tuple[tuple[str, str], ...]:
        """``(tag, source rule)`` pairs the principal holds, in config order, first source per tag."""
        name = self.principal_of(principal)
        cached = self._grant_cache.get(name)
        if cached is not None:
            return cached
        seen: dict[str, str] = {}
        for rule in self._rules_for(name):
            for tag in rule.grants:
                seen.setdefault(tag, rule.source)
        result = tuple(seen.items())
        if len(self._grant_cache) < 10_000:  # principals are few; never let a flood of names grow it
            self._grant_cache[name] = result
        return result

    def check(self, principal: str | None, spec: ToolSpec, args: Mapping[str, Any] | None = None) -> Decision:
        """Judge one call; ``args`` are the effective args (after ``tool_request`` middleware)."""
        who = self.principal_of(principal)
        tool = spec.name
        rules = self._rules_for(who)

        def deny(rule: str, message: str, missing: tuple[str, ...] = ()) -> Decision:
            return Decision(False, rule, missing, message, who, tool)

        if _matches(tool, self.deny_tools):
            return deny("deny_tools", f"tool {tool!r} is denied for everyone by policy.deny_tools")
        for r in rules:
            if _matches(tool, r.deny_tools):
                return deny(
                    f"{r.source}.deny_tools", f"tool {tool!r} is denied to {who!r} by {r.source}.deny_tools"
                )
        if self.allow_tools is not None and not _matches(tool, self.allow_tools):
            return deny("allow_tools", f"tool {tool!r} is not in policy.allow_tools")
        for r in rules:
            if r.allow_tools is not None and not _matches(tool, r.allow_tools):
                return deny(f"{r.source}.allow_tools", f"tool {tool!r} is not in {r.source}.allow_tools")

        if spec.permissions is None:
            if self.mode == STRICT:
                return deny("mode.strict", f"tool {tool!r} declares no permissions and policy.mode is strict")
            granted_rule = "mode.permissive"
        else:
            held = {t for t, _ in self.grants_of(who)}
            missing = () if ALL_TAGS in held else tuple(t for t in spec.permissions if t not in held)
            if missing:
                return deny(
                    "permissions",
                    f"principal {who!r} lacks permission(s) {', '.join(missing)} for tool {tool!r}",
                    missing,
                )
            granted_rule = "permissions"

        if args:
            for pr in self.path_rules:
                if not _matches(tool, (pr.tool,)):  # a name or a glob ("*": every tool)
                    continue
                for name, value in pr.judged(spec, args):
                    bad = _outside(value, pr.allow)
                    if bad is not None:
                        return deny(
                            f"args.path_prefixes.{pr.tool}",
                            f"argument {name!r} of tool {tool!r} = {bad!r} is outside the allowed prefixes "
                            f"{list(pr.allow)}",
                        )
        return Decision(True, granted_rule, (), f"principal {who!r} may call tool {tool!r}", who, tool)

    def enforce(
        self, principal: str | None, spec: ToolSpec, args: Mapping[str, Any] | None = None
    ) -> Decision:
        """``check``, raising PermissionDenied (details: tool, principal, missing, rule) on refusal; its message
        says the rule that refused and how to allow the call (``policy explain``'s fix)."""
        decision = self.check(principal, spec, args)
        if not decision.allowed:
            from workers.policy_explain import fix

            raise PermissionDenied(
                f"permission denied: {decision.message}; to allow it: {fix(self, decision, spec)}",  # seed's words
                tool=decision.tool,
                principal=decision.principal,
                missing=list(decision.missing),
                rule=decision.rule,
            )
        return decision

    def allowed_tools(self, principal: str | None, specs: Iterable[ToolSpec]) -> list[ToolSpec]:
        """The specs this principal may call (argument rules cannot be judged without args)."""
        return [s for s in specs if self.check(principal, s).allowed]

    def explain(self, principal: str | None, spec: ToolSpec, args: Mapping[str, Any] | None = None) -> str:
        """A human explanation of the verdict (see ``workers.policy_explain``)."""
        from workers.policy_explain import explain

        return explain(self, principal, spec, args)

    def daily_tokens(self, principal: str | None) -> int | None:
        """The principal's daily token budget: the first matching ``principals`` entry that sets one."""
        return next((r.daily_tokens for r in self.rules_for(principal) if r.daily_tokens is not None), None)

    def rules_for(self, principal: str | None) -> list[PrincipalRule]:
        """The ``principals`` entries that match this principal, in config order."""
        return self._rules_for(self.principal_of(principal))

    def _rules_for(self, name: str) -> list[PrincipalRule]:
        return [r for r in self.principals if r.pattern == name or fnmatchcase(name, r.pattern)]



def _names(value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: expected a list of names, got {value!r}")
    return tuple(value)


def _known_keys(where: str, given: set[Any], known: set[str]) -> None:
    """A typo is an error: a silently ignored rule is a hole."""
    if given - known:
        raise ConfigError(f"{where}: unknown key(s) {sorted(given - known)}; expected some of {sorted(known)}")


def _principal(name: str, raw: Any) -> PrincipalRule:
    where = f"policy.principals.{name}"
    raw = {} if raw is None else raw
    if isinstance(raw, list):  # shorthand: agent-a: [read_only, write]
        raw = {"grants": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping with some of {sorted(_PRINCIPAL_KEYS)}")
    _known_keys(where, set(raw), _PRINCIPAL_KEYS)
    return PrincipalRule(
        pattern=name,
        grants=_names(raw.get("grants"), f"{where}.grants") or (),
        deny_tools=_names(raw.get("deny_tools"), f"{where}.deny_tools") or (),
        allow_tools=_names(raw.get("allow_tools"), f"{where}.allow_tools"),
        daily_tokens=_budget(raw.get("daily_tokens"), f"{where}.daily_tokens"),
    )


def _budget(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: expected a whole number of tokens >= 0, got {value!r}")
    return value


def _path_rule(tool: str, raw: Any) -> PathRule:
    where = f"policy.args.path_prefixes.{tool}"
    if isinstance(raw, str | list | tuple):
        allow = _names(raw, where)
        return PathRule(tool, tuple(_norm(p) for p in allow or ()))
    if isinstance(raw, Mapping) and set(raw) <= {"allow", "args", "arg"} and "allow" in raw:
        names = _names(raw.get("args", raw.get("arg")), f"{where}.args")
        allow = _names(raw["allow"], f"{where}.allow") or ()
        return PathRule(tool, tuple(_norm(p) for p in allow), names)
    raise ConfigError(f"{where}: expected a list of prefixes or {{allow: [...], args: [...]}}")


def _norm(path: str) -> str:
    return posixpath.normpath(path) if path else path


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(p == name or fnmatchcase(name, p) for p in patterns)


def _outside(value: Any, allow: tuple[str, ...]) -> Any:
    """The offending value when ``value`` (a path or list of paths) leaves every prefix, else None."""
    values = value if isinstance(value, list | tuple) else [value]
    for v in values:
        if not isinstance(v, str):
            return v
        # Normalise first so "/srv/data/../../etc/passwd" is judged as "/etc/passwd".
        path = _norm(v)
        if not any(path == p or path.startswith(p.rstrip("/") + "/") for p in allow):
            return v
    return None
