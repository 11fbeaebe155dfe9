"""``hermes-gateway migrate``: the v0.9 tool files imported into the tool directory."""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict

import click

from hermes_gateway.cli.common import fail, note, open_gateway, outcome_line, settings_of


@click.command()
@click.option(
    "--force", is_flag=True, help="Replace tools the directory already holds with a different spec."
)
@click.option("--dry-run", is_flag=True, help="Report what would happen; change nothing.")
@click.option("--no-rewrite", is_flag=True, help="Leave old per-file specs in tools/ as they are.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.pass_context
def migrate(ctx: click.Context, force: bool, dry_run: bool, no_rewrite: bool, as_json: bool) -> None:
    """Import the v0.9 tool files ($HERMES_HOME/tools.json, tools/*, and the tools: list of config.yaml or
    config.json, which is read and left as it is) into the tool directory."""
    from hermes_gateway.migrate import migrate as run_migration

    settings = settings_of(ctx)
    with open_gateway(settings, need_workers=False) as (gw, _):
        embedded = gw.broker.embedded is not None
        if embedded:  # its directory starts empty: first what every command loads (a v0.9 file there is skipped)
            gw.sync_tools(errors=[])
        try:
            outcomes = run_migration(
                gw.directory, settings.home, force=force, rewrite=not no_rewrite, dry_run=dry_run,
                to_files=embedded,
            )
        except OSError as e:
            fail(f"cannot read the old tool files: {e}")
    if as_json:
        click.echo(json.dumps([asdict(o) for o in outcomes], ensure_ascii=False, indent=2))
        if any(o.failed for o in outcomes):
            sys.exit(1)
        return
    if not outcomes:
        click.echo(
            f"nothing to migrate: no tools.json, tools.yaml, tools/ specs or config tools: list in {settings.home}"
        )
        return
    for o in outcomes:
        click.echo(outcome_line(o.status, o.name, o.version, o.source, o.reason))
    counts = Counter(o.status for o in outcomes)
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    click.echo(f"{'dry run: ' if dry_run else ''}{summary}")
    if embedded:
        note(
            "note: the embedded broker lasts only for this command; the specs were written to "
            f"{settings.tools_dir} so every command loads them. Set HERMES_REDIS_URL to fill a shared directory."
        )
    failed = sum(o.failed for o in outcomes)
    if failed:  # scripts see it: the rest was migrated, these were not
        fail(
            f"{failed} spec(s) could not be migrated (see 'skipped' above); fix them and run migrate again", 1
        )
