"""``pretrain compare A B …``: campaigns side by side, read from MLflow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from pretrain.cli.errors import describe, err, fail, fail_fast_on_mlflow, refused


def compare(
    campaigns: list[str] = typer.Argument(
        ..., help="Campaigns to compare: workdirs, MLflow campaign run ids or campaign names."
    ),
    tracking_uri: str | None = typer.Option(
        None,
        "--tracking-uri",
        help="The MLflow store to find run ids and names in (default: MLFLOW_TRACKING_URI, else "
        "./mlflow.db). A workdir's campaign is read from the store its ledger records.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object per campaign) instead of a table."),
    png: Path | None = typer.Option(
        None, "--png", help="Also write a PNG of eval loss against tokens seen for all of them."
    ),
) -> None:
    """Compare campaigns: tokens seen, final and best eval loss, goodput, wall time, restarts,
    rollbacks, checkpoint blocking, and the parameters that differ."""
    from pretrain.tracking.store import shared_tracking_uri
    from pretrain.views.compare import CompareError
    from pretrain.views.compare import compare as gather
    from pretrain.views.compare_table import plot_eval_loss, table

    fail_fast_on_mlflow()
    uri = tracking_uri or shared_tracking_uri()
    if png is not None:
        _refuse_png_target(png)
    with refused(CompareError):
        summaries = gather(campaigns, uri)
    if png is not None:
        with refused(RuntimeError, OSError):
            try:
                plot_eval_loss(summaries, png)
            except OSError as e:
                raise OSError(f"cannot write --png {png}: {describe(e)}") from None
    if as_json:
        sys.stdout.write(json.dumps([s.to_json() for s in summaries], indent=2) + "\n")
        _print_notes(summaries)
        return
    header, rows = table(summaries)
    shown = Table(*header, title="campaigns compared")
    for row in rows:
        shown.add_row(*row)
    Console(soft_wrap=True, width=None if sys.stdout.isatty() else 240).print(shown)
    if png is not None:
        sys.stdout.write(f"eval loss vs tokens: {png}\n")
    _print_notes(summaries)


def _print_notes(summaries) -> None:
    from pretrain.views.compare import same_campaign_notes

    sys.stdout.flush()  # after what stdout shows, on a terminal too
    for note in same_campaign_notes(summaries):
        err.print(f"note: {note}", highlight=False)


def _refuse_png_target(png: Path) -> None:
    """Exit 2 before anything is read if ``--png`` would replace a file that is not a picture of
    ours (a typo naming the spec or the notes), or names no PNG."""
    if png.suffix.lower() != ".png":
        raise fail(f"--png {png}: give a path ending in .png")
    try:
        head = png.read_bytes()[:8] if png.exists() else None
    except OSError as err:
        raise fail(f"--png {png}: {describe(err)}") from None
    if head is not None and head != b"\x89PNG\r\n\x1a\n":
        raise fail(f"--png {png} exists and is not a PNG: give a new path (nothing was overwritten)")
