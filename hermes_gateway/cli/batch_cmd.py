"""``hermes-gateway batch``: submit a JSONL file of arguments as a batch, follow it, resume, cancel, list."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import click

from broker.errors import HermesError
from hermes_gateway.cli.common import (
    POSITIVE,
    WAIT_SECONDS,
    fail,
    failing,
    note,
    open_gateway,
    settings_of,
    sync_tools,
)


@click.group()
def batch() -> None:
    """Run a tool over many items (JSONL in, JSONL out); follow, resume and cancel by batch id."""


def read_items(path: Path) -> Iterator[Any]:
    """The items of a JSONL file, one per non-blank line, read as they are needed. A line that is not JSON
    is passed on as its text: the batch records it as a failed item (``invalid_args``), it stops nothing."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield line.rstrip("\n")


@contextlib.contextmanager
def _job(ctx: click.Context, batch_id: str) -> Iterator[Any]:
    """The batch ``batch_id``; a HermesError in the block (no such batch, ...) ends the command with 1."""
    with open_gateway(settings_of(ctx), need_workers=False) as (gw, _):
        with failing(1):
            yield gw.batch_job(batch_id)


def _exit_code(p: Any) -> int:
    """0 when every item is done, 1 when any failed or was cancelled."""
    return 1 if p.counts.get("failed") or p.counts.get("cancelled") else 0


def count_items(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def item_line(item: Any) -> str:
    return json.dumps(item.to_dict(), ensure_ascii=False, default=str)


def _status_text(p: Any) -> str:
    d = p.to_dict()
    counts = " ".join(f"{k}={v}" for k, v in d["counts"].items())
    total = "?" if d["total"] is None else d["total"]
    eta = "-" if d["eta"] is None else f"{d['eta']:.1f}s"
    return (
        f"batch {d['id']} ({d['tool']}): {d['state']}, {d['finished']}/{total} ended ({counts}), "
        f"{d['running']} in flight, submitted {d['submitted']}, {d['rate']:.1f}/s, ETA {eta}"
    )


def _follow(gw: Any, job: Any, out: IO[str] | None, total: int | None, show: bool) -> Any:
    """Write results to ``out`` as they come (if given) and draw a progress bar on stderr until the batch is
    complete or its submitter failed; returns the final progress."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from hermes_gateway.batches import Cursor

    store, cursor = job.store, Cursor()
    queues = store.meta(job.id)["queues"].split(",")
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]:.1f}/s"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not show, transient=False) as bar:
        task = bar.add_task(job.id, total=total, rate=0.0)
        while True:
            p = store.progress(job.id)
            items = store.read(job.id, queues, cursor)
            if out is not None:
                for item in items:
                    out.write(item_line(item) + "\n")
                out.flush()
            bar.update(task, completed=p.finished, rate=p.rate, total=p.total or total)
            if not items and (p.complete or job.error is not None):
                return p
            if not items:
                time.sleep(0.2)


@batch.command("submit")
@click.argument("tool", required=False)
@click.argument("items", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=False)
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write each item's outcome to this JSONL file as the calls end (rewritten on --resume).")
@click.option("--resume", "resume", default=None, metavar="ID",
              help="Take up batch ID again (its submitter died): items with a result are not sent again.")
@click.option("--window", type=POSITIVE, default=None, help="Calls unfinished at most (default batch.window).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--principal", default=None)
@click.pass_context
def batch_submit(ctx: click.Context, tool: str | None, items: Path | None, out_path: Path | None,
                 resume: str | None, window: int | None, no_progress: bool, principal: str | None) -> None:
    """Run TOOL over ITEMS (a JSONL file: one JSON object of arguments a line). Prints the batch id at once,
    then a progress bar on stderr; `batch submit --resume ID [TOOL] ITEMS` after the submitter died."""
    if items is None and tool is not None and resume is not None and Path(tool).exists():
        items, tool = Path(tool), None  # `--resume ID items.jsonl`: the tool is the batch's own
    if items is None:
        fail("name the items file: batch submit TOOL items.jsonl (or --resume ID items.jsonl)")
    settings = settings_of(ctx)
    with open_gateway(settings) as (gw, _):
        sync_tools(gw)
        from hermes_gateway.local import THROWAWAY_NOTE, throwaway

        if throwaway(gw):  # the batch would end with this command: nothing to resume after a crash
            note(THROWAWAY_NOTE.format(home=settings.home) + ": a batch there cannot be resumed after this "
                  "command dies; start `hermes-gateway serve` (or `worker`) first", "warning")
        try:
            if resume is not None:
                tool = tool or gw.batch_job(resume).progress().tool
            if tool is None:
                fail("name the tool: batch submit TOOL items.jsonl")
            total = count_items(items)
            context = {"principal": principal} if principal else {}
            job = gw.batch(tool, read_items(items), window=window, resume=resume, **context)
        except HermesError as e:
            fail(f"{e.__class__.__name__}: {e}", 1)
        click.echo(job.id)
        sys.stdout.flush()
        note(f"batch {job.id}: {total} items of {tool}" + (" (resumed)" if resume else ""))
        with out_path.open("w", encoding="utf-8") if out_path else contextlib.nullcontext() as out:
            try:
                p = _follow(gw, job, out, total, not no_progress)
            except KeyboardInterrupt:
                fail(f"interrupted: resume with `hermes-gateway batch submit --resume {job.id} {items}`", 130)
        if job.error is not None:
            fail(f"batch {job.id}: submission stopped: {job.error}; resume with --resume {job.id}", 1)
        note(_status_text(p))
        sys.exit(_exit_code(p))


@batch.command("status")
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def batch_status(ctx: click.Context, batch_id: str, as_json: bool) -> None:
    """Counts per state, rate and ETA of a batch."""
    with _job(ctx, batch_id) as job:
        p = job.progress()
        click.echo(json.dumps(p.to_dict(), indent=2) if as_json else _status_text(p))


@batch.command("wait")
@click.argument("batch_id")
@click.option("--timeout", type=WAIT_SECONDS, default=None, help="Seconds to wait at most (exit 3 when reached).")
@click.pass_context
def batch_wait(ctx: click.Context, batch_id: str, timeout: float | None) -> None:
    """Block until every item of the batch has ended; exit 0 when all are done, 1 otherwise."""
    with _job(ctx, batch_id) as job:
        p = job.wait(timeout)
        click.echo(_status_text(p))
        sys.exit(_exit_code(p) if p.complete else 3)


@batch.command("results")
@click.argument("batch_id")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSONL to this file instead of stdout.")
@click.option("--no-follow", is_flag=True, help="Only the results there are now; do not wait for the rest.")
@click.pass_context
def batch_results(ctx: click.Context, batch_id: str, out_path: Path | None, no_follow: bool) -> None:
    """Each item's outcome as a JSONL line `{index, call_id, state, result | error}`, as the calls end."""
    with _job(ctx, batch_id) as job:
        with out_path.open("w", encoding="utf-8") if out_path else contextlib.nullcontext(sys.stdout) as out:
            for item in job.results(follow=not no_follow):
                out.write(item_line(item) + "\n")
                out.flush()


@batch.command("cancel")
@click.argument("batch_id")
@click.pass_context
def batch_cancel(ctx: click.Context, batch_id: str) -> None:
    """Stop sending the batch's items and cancel its calls that have not ended."""
    with _job(ctx, batch_id) as job:
        n = job.cancel()
        click.echo(f"batch {batch_id}: {job.progress().to_dict()['state']}, {n} calls told to stop")


@batch.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def batch_list(ctx: click.Context, as_json: bool) -> None:
    """The batches on record, newest first."""
    from hermes_gateway.batches import BatchStore

    with open_gateway(settings_of(ctx), need_workers=False) as (gw, _):
        rows = BatchStore(gw.conn).recent()
        if as_json:
            click.echo(json.dumps([p.to_dict() for p in rows], indent=2))
            return
        if not rows:
            click.echo("no batches")
        for p in rows:
            click.echo(_status_text(p))
