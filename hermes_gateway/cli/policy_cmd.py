"""``hermes-gateway policy push|show|clear|explain``: the active policy every worker judges calls by."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import click
import yaml

from broker.errors import ConfigError, HermesError
from hermes_gateway.cli.common import fail, failing, open_gateway, settings_of, shared_broker, sync_tools
from workers import policy_store
from workers.policy import Policy

_WHERE = "the active policy"  # (lives in the broker)


def read_policy_file(path: Path) -> Policy:
    """A policy from a YAML file: a whole config.yaml (its ``policy:``) or the bare policy mapping."""
    from broker.config import expand_env

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: {e}") from e
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping")
    data = raw.get("policy") if "policy" in raw else raw
    return Policy.from_settings(expand_env(dict(data or {})))


def _summary(policy: Policy) -> str:
    return (
        f"mode {policy.mode}, {len(policy.principals)} principal rule(s), "
        f"{len(policy.deny_tools)} denied tool pattern(s), {len(policy.path_rules)} path rule(s)"
    )


@click.group()
def policy() -> None:
    """Inspect the permission policy."""


@policy.command("push")
@click.option(
    "--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A YAML file with a policy: mapping (default: config.yaml in $HERMES_HOME).",
)
@click.pass_context
def policy_push(ctx: click.Context, path: Path | None) -> None:
    """Make config.yaml's policy (or --file's) the one every worker uses, from its next call on."""
    settings = settings_of(ctx)
    source = path or settings.config_path
    with failing():
        policy = read_policy_file(path) if path else Policy.from_settings(settings.policy)
    with shared_broker(settings, _WHERE) as handle:
        version, changed = policy_store.push(handle.conn, policy, source=str(source))
    if changed:
        pushed = f"policy version {version} pushed from {source} ({_summary(policy)})"
        click.echo(f"{pushed}; workers apply it now")
    else:
        click.echo(f"policy unchanged (version {version} is the same policy)")


@policy.command("show")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def policy_show(ctx: click.Context, as_json: bool) -> None:
    """The policy workers use now: the pushed one, else config.yaml's."""
    settings = settings_of(ctx)
    with shared_broker(settings, _WHERE) as handle:
        try:
            stored = policy_store.load(handle.conn)
        except HermesError as e:
            fail(f"the stored policy is unreadable ({e}); workers keep the policy they had: push a new one")
    if stored.policy is not None:
        policy, origin = stored.policy, "redis"
        pushed = datetime.fromtimestamp(stored.pushed_at).astimezone().isoformat(timespec="seconds")
        header = f"active policy: version {stored.version}, pushed {pushed} from {stored.source or '?'}"
    else:
        with failing():
            policy, origin = Policy.from_settings(settings.policy), "config.yaml"
        header = f"no policy pushed to {handle.description}; workers use their config.yaml's (this one's:)"
    if as_json:
        doc = {
            "origin": origin, "version": stored.version, "source": stored.source, "policy": policy.to_dict()
        }
        click.echo(json.dumps(doc, ensure_ascii=False, indent=2))
        return
    click.echo(header)
    click.echo(yaml.safe_dump(policy.to_dict(), allow_unicode=True, sort_keys=False).rstrip())


@policy.command("clear")
@click.pass_context
def policy_clear(ctx: click.Context) -> None:
    """Drop the pushed policy: every worker goes back to its own config.yaml's."""
    with shared_broker(settings_of(ctx), _WHERE) as handle:
        version = policy_store.clear(handle.conn)
    click.echo("policy cleared; workers use their config.yaml's" if version else "no policy was pushed")


@policy.command("explain")
@click.argument("principal")
@click.argument("tool_name")
@click.pass_context
def policy_explain(ctx: click.Context, principal: str, tool_name: str) -> None:
    """Why PRINCIPAL may or may not call TOOL (the 'listed but permission denied' question)."""
    with open_gateway(settings_of(ctx), need_workers=False) as (gw, _):
        sync_tools(gw, write=False)
        with failing():
            spec = gw.tool(tool_name).spec
            pol = gw.policy()  # the pushed policy wins
        click.echo(pol.explain(principal, spec))
