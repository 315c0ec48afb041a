"""``pretrain data``: prepare a campaign's data set with a progress display, inspect a data set."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from pretrain.cli.errors import err, fail, refused
from pretrain.console_progress import ProgressDisplay, progress_display
from pretrain.data.prepare.progress import PrepProgress
from pretrain.run.stop import InterruptLatch, interrupt_latch

data_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Prepare a campaign's data set, or inspect a prepared one."
)


def show_on(display: ProgressDisplay, latch: InterruptLatch | None = None):
    """A ``ProgressCallback`` drawing preparation's snapshots on ``display`` (and raising a Ctrl-C
    that ``latch`` holds but that did not stop the work where it landed)."""

    def show(p: PrepProgress) -> None:
        if latch is not None:
            latch.check()
        fields = {"units": f"{p.units_done}/{p.units_total}"} if p.units_total else {}
        if p.tokens or p.documents:
            fields.update(documents=p.documents, tokens=p.tokens)
        display.update(p.bytes_done, p.bytes_total, p.phase, **fields)

    return show


def out() -> Console:
    """Stdout: a terminal's width, or wide enough that piped tables keep whole paths."""
    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 240)


@data_app.command("prepare")
def prepare(
    spec: str | None = typer.Argument(None, help="Campaign spec YAML (default: the built-in tiny demo)."),
    workdir: Path | None = typer.Option(
        None, "--workdir", "-w", help="Where the campaign keeps its state (overrides the spec)."
    ),
    interval: float = typer.Option(
        10.0, "--interval", min=0.0, help="Seconds between progress lines when not on a terminal."
    ),
) -> None:
    """Prepare (or reuse) the campaign's data set as `pretrain run` does first, then print its stats; after a kill,
    the same command resumes."""
    from pretrain.spec.campaign import SpecError
    from pretrain.spec.file import load_spec

    try:
        campaign = load_spec(spec or "builtin:tiny").with_workdir(workdir)
    except SpecError as e:
        raise fail(str(e))
    from pretrain.cli.before_start import refuse_before_starting
    from pretrain.data.identity import DataChanged
    from pretrain.state.ledger import CampaignMismatch, LedgerError
    from pretrain.state.lock import CampaignBusy

    try:
        refuse_before_starting(campaign, sources=True)
    except (ValueError, CampaignMismatch, LedgerError) as e:
        raise fail(str(e))
    from deployments.local_prepare import prepare_data_here

    display = progress_display("data", unit="B", rated=("tokens",), interval_s=interval)
    try:
        with interrupt_latch() as latch:
            summary = prepare_data_here(campaign, progress=show_on(display, latch))
    except KeyboardInterrupt:
        display.close()
        err.print("interrupted: finished work units are kept; run the same command to resume", highlight=False)
        raise typer.Exit(130)
    except (ValueError, CampaignBusy, CampaignMismatch, LedgerError, DataChanged) as e:  # bad sources
        # (DataPrepError, CorpusError), the workdir busy, of another campaign, its ledger damaged, or
        # the corpus changed under the campaign's checkpoints
        display.close()
        raise fail(str(e))
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        display.close()
        raise fail(f"data preparation failed: {type(e).__name__}: {e}", 1)
    display.close()
    from pretrain.data.inspection import render_summary

    render_summary(_stats(campaign, summary), out())


def _stats(campaign, summary: dict) -> dict:
    """The prepared data set's manifest (shards and sources too), or the flow's summary where the
    data set cannot be read from here (S3 behind a block's credentials)."""
    from pretrain.data.inspection import InspectError, open_data_set
    from pretrain.state.locations import s3_options

    location = str(summary.get("location") or "")
    data, ckpt = campaign.data, campaign.checkpoint
    options = s3_options(data.s3_endpoint_url or ckpt.s3_endpoint_url, data.s3_region or ckpt.s3_region)
    try:
        return {**summary, **open_data_set(location, options if location.startswith("s3://") else None).manifest}
    except InspectError:
        return summary


@data_app.command("inspect")
def inspect(
    location: str | None = typer.Argument(
        None,
        help="A prepared data set (its directory with manifest.json, or s3:// URL), or a campaign's workdir: its "
        "data set. Default: the campaign run here.",
    ),
    windows: int = typer.Option(3, "--windows", min=0, help="Random train windows to decode."),
    tokens: int = typer.Option(64, "--tokens", min=1, help="Tokens per decoded window."),
    seed: int = typer.Option(0, "--seed", help="Seed choosing the windows."),
    s3_endpoint_url: str | None = typer.Option(
        None, "--s3-endpoint-url", help="S3-compatible endpoint; credentials from the AWS environment."
    ),
    s3_region: str | None = typer.Option(None, "--s3-region", help="S3 region."),
    all_sources: bool = typer.Option(
        False, "--all-sources", help="One row per source file (default: the first 20, the others summed)."
    ),
) -> None:
    """Print a data set's stats (documents, tokens, sources, skips, duplicates, tokenizer, fingerprint) and decode a
    few random train windows."""
    from pretrain.cli.workdir_lookup import campaign_data_set, is_campaign_workdir
    from pretrain.data.inspection import SOURCE_ROWS, InspectError, inspect_data_set
    from pretrain.state.ledger import LedgerError
    from pretrain.state.locations import s3_options
    from pretrain.views.status import NoCampaign

    if location is None or is_campaign_workdir(location):
        with refused(NoCampaign, LedgerError):
            location = campaign_data_set(Path(location) if location else None)
    try:
        inspect_data_set(
            location,
            out(),
            windows=windows,
            window_tokens=tokens,
            seed=seed,
            source_rows=None if all_sources else SOURCE_ROWS,
            s3_options=s3_options(s3_endpoint_url, s3_region),
        )
    except InspectError as e:
        raise fail(str(e))
    sys.stdout.flush()
