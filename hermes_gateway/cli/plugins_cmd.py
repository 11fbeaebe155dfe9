"""``hermes-gateway plugins``: list, enable, disable and reload middleware plugins."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from hermes_gateway.cli.common import fail, settings_of, shared_broker

if TYPE_CHECKING:
    from broker.connection import BrokerHandle


@click.group()
def plugins() -> None:
    """Enable, disable, list and reload middleware plugins (same config.yaml as the Hermes agent)."""


@plugins.command("list")
@click.pass_context
def plugins_list(ctx: click.Context) -> None:
    """Every plugin found, and whether it is enabled."""
    from middleware import list_plugins

    settings = settings_of(ctx)
    found = list_plugins(settings.home, discovery=settings.plugin_discovery)
    if not found:
        click.echo(f"no plugins in {settings.plugins_dir} or the hermes_agent.plugins entry points")
    for info in found:
        mark = "enabled " if info.enabled else "disabled"
        err = f"  error: {info.error}" if info.error else ""
        click.echo(f"{mark}  {info.name:<32} {info.source:<12} {info.description or ''}{err}")


@plugins.command("enable")
@click.argument("name")
@click.pass_context
def plugins_enable(ctx: click.Context, name: str) -> None:
    """Enable a plugin (written to plugins.enabled in config.yaml)."""
    from middleware import enable_plugin

    key = _toggle(ctx, enable_plugin, name)
    click.echo(f"enabled {key}; {_reload_running(ctx)}")


@plugins.command("disable")
@click.argument("name")
@click.pass_context
def plugins_disable(ctx: click.Context, name: str) -> None:
    """Disable a plugin (its middleware stops in the running workers too)."""
    from middleware import disable_plugin

    key = _toggle(ctx, disable_plugin, name)
    click.echo(f"disabled {key}; {_reload_running(ctx)}")


def _reload_running(ctx: click.Context) -> str:
    """Tell the running workers of this home's broker to reload their plugins (a plugin disabled here must
    not go on running in them); what happened, as a sentence's end."""
    from broker.errors import HermesError
    from hermes_gateway.local import connect_shared

    try:
        handle = connect_shared(settings_of(ctx))
    except HermesError:  # (no shared broker: no worker of this home is running, or one an env var names)
        return "workers started from now on read it (`hermes-gateway plugins reload` tells running ones)"
    try:
        reached = _send_reload(handle)
    finally:
        handle.close()
    return f"reload sent to the workers on {handle.description} ({reached} listening)"


def _send_reload(handle: BrokerHandle) -> int:
    """Publish ``reload`` on the control channel of ``handle``'s broker; how many workers listened."""
    from broker import keys
    from workers.worker import control_message

    return int(handle.conn.publish(keys.channel(handle.conn, keys.CONTROL_CHANNEL), control_message("reload")))


def _toggle(ctx: click.Context, change: Callable[..., str], name: str) -> str:
    """``enable_plugin`` or ``disable_plugin`` on this home's config.yaml; an unknown plugin exits 2."""
    settings = settings_of(ctx)
    try:
        return change(settings.home, name, discovery=settings.plugin_discovery)
    except LookupError as e:
        fail(str(e))


@plugins.command("reload")
@click.pass_context
def plugins_reload(ctx: click.Context) -> None:
    """Make every running worker re-import its plugins (and re-read policy) without a restart."""
    with shared_broker(settings_of(ctx)) as handle:
        reached = _send_reload(handle)
        click.echo(f"reload sent to workers on {handle.description} ({reached} listening)")
