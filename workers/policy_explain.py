"""``hermes-gateway policy explain``: the verdict on one principal and tool, in words, with the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.toolspec import ToolSpec
from workers.policy import STRICT, Decision, Policy


def explain(
    policy: Policy, principal: str | None, spec: ToolSpec, args: Mapping[str, Any] | None = None
) -> str:
    """A human explanation of the verdict: mode, what the tool needs, what the principal holds, the fix."""
    who = policy.principal_of(principal)
    d = policy.check(principal, spec, args)
    lines = [f"policy: may principal {who!r} call tool {spec.name!r}?"]
    if not principal:
        lines.append(f"  principal:      none in the call context, so it acts as default_principal {who!r}")
    undeclared = "refused in strict mode" if policy.mode == STRICT else "allowed to anyone"
    lines.append(f"  mode:           {policy.mode} (a tool with no permissions declaration is {undeclared})")
    if spec.permissions is None:
        lines.append("  tool declares:  no permissions declaration")
    elif not spec.permissions:
        lines.append("  tool declares:  an empty declaration (no tags needed)")
    else:
        lines.append(f"  tool declares:  {', '.join(spec.permissions)} (every one is needed)")
    held = policy.grants_of(who)
    matched = [r.source for r in policy.rules_for(who)]
    lines.append(
        f"  rules matching: {', '.join(matched) if matched else 'none (no policy.principals entry)'}"
    )
    if held:
        lines.append("  principal holds:")
        lines.extend(f"    {tag:<14} from {src}.grants" for tag, src in held)
    else:
        lines.append("  principal holds: no tags")
    if d.missing:
        lines.append(f"  missing:        {', '.join(d.missing)}")
    verdict = "ALLOWED" if d.allowed else "DENIED"
    lines.append(f"  verdict:        {verdict} by rule {d.rule!r}: {d.message}")
    lines.append(f"  how to fix:     {fix(policy, d, spec)}")
    return "\n".join(lines)


def fix(policy: Policy, d: Decision, spec: ToolSpec) -> str:
    """What to change so the verdict flips (or why nothing needs to)."""
    tool, who = spec.name, d.principal
    if d.allowed:
        if spec.permissions is None:
            return (
                "nothing to fix; but the tool declares no permissions, so strict mode would refuse it: "
                f"add `permissions: [...]` to the spec of {tool!r}"
            )
        return "nothing to fix"
    if d.rule == "mode.strict":
        return (
            f"declare `permissions: [tags]` in the spec of {tool!r} (`permissions: []` needs no tags), "
            "or set policy.mode: permissive (not recommended in production)"
        )
    if d.rule == "permissions":
        if any(r.pattern == who for r in policy.principals):
            where = f"policy.principals.{who}.grants"
        else:
            where = f"a new entry policy.principals.{who}: {{grants: [...]}}"
        return (
            f"grant {', '.join(d.missing)} in {where} (config.yaml), or call as a principal that holds them"
        )
    if d.rule.endswith("deny_tools"):
        return f"remove {tool!r} (or the pattern matching it) from policy.{d.rule}"
    if d.rule.endswith("allow_tools"):
        return f"add {tool!r} to policy.{d.rule}"
    if d.rule.startswith("args.path_prefixes"):
        return f"pass a path under an allowed prefix, or add its prefix to policy.{d.rule}"
    return f"change the rule policy.{d.rule}"
