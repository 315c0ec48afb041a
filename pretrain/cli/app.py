"""``pretrain`` command line: run a campaign, show where one stands, evaluate or export a checkpoint."""

from __future__ import annotations

import json
import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path

import typer

from pretrain.cli.errors import describe, err, fail, refused

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fault-tolerant LLM pre-training campaigns orchestrated by Prefect.",
)


def _add_sub_apps() -> None:
    from pretrain.cli.cluster import cluster_app
    from pretrain.cli.compare import compare
    from pretrain.cli.data import data_app
    from pretrain.cli.report import report
    from pretrain.cli.stacks import stacks

    app.add_typer(data_app, name="data")
    app.add_typer(cluster_app, name="cluster")
    app.command("compare")(compare)
    app.command("report")(report)
    app.command("stacks")(stacks)


_add_sub_apps()


@app.command()
def run(
    spec: str | None = typer.Argument(None, help="Campaign spec YAML (default: the built-in tiny demo)."),
    workdir: Path | None = typer.Option(
        None, "--workdir", "-w", help="Where the campaign keeps its state (overrides the spec)."
    ),
    run_for: str | None = typer.Option(
        None,
        "--for",
        help="Time budget (2h, 90m, 1h30m): then pause at a validated checkpoint; the same command continues.",
    ),
    until: str | None = typer.Option(
        None, "--until", help="Pause by this time (06:00, or an ISO date and time); with --for, the earlier wins."
    ),
) -> None:
    """Run a campaign, or resume it: the same command after any crash continues where it stopped."""
    from pretrain.cluster.local import not_runnable
    from pretrain.run.budget import BudgetError, PauseRequest, deadline, pausing
    from pretrain.spec.campaign import SpecError
    from pretrain.spec.file import load_spec

    with refused(SpecError, BudgetError):
        pause = PauseRequest(deadline=deadline(run_for, until))  # counted from now
        campaign = load_spec(spec or "builtin:tiny").with_workdir(workdir)
        if why := not_runnable(campaign.cluster):
            raise SpecError(why)
    from pretrain.cli.before_start import refuse_before_starting
    from pretrain.spec.layout import UnusableWorkdir
    from pretrain.state.ledger import CampaignMismatch, LedgerError

    with refused(LedgerError, CampaignMismatch, UnusableWorkdir):
        refuse_before_starting(campaign)
    from deployments.live_progress import training_display
    from deployments.local_run import run_campaign_here
    from pretrain.run.stop import CampaignInterrupted, CampaignPaused, StoppedAtOnce
    from pretrain.views.status import render

    try:
        # the flow reads the status with the blocks' credentials, which stay in the flow
        with training_display(campaign.workdir_path), pausing(pause):  # a live display; a signal pauses
            final = run_campaign_here(campaign, notice=lambda msg: err.print(msg, highlight=False))
    except (CampaignMismatch, LedgerError) as e:
        raise fail(str(e)) from None
    except CampaignInterrupted as e:
        err.print(
            f"[yellow]{'paused' if isinstance(e, CampaignPaused) else 'interrupted'}:[/yellow] {e}", highlight=False
        )
        _render_where_it_stands(campaign.workdir_path)
        err.print(f"Run the same command to resume: {_this_command()}", highlight=False)
        if isinstance(e, StoppedAtOnce):  # the flow thread may still be unwinding: do not wait for it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
        raise typer.Exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - report, show where the campaign stands, exit non-zero
        err.print(f"[red]campaign failed:[/red] {e}", highlight=False)
        _render_where_it_stands(campaign.workdir_path)
        raise typer.Exit(1)
    render(final)
    if final["status"] == "paused":
        from pretrain.run.outcome import pause_cause

        err.print(f"[yellow]campaign {pause_cause(campaign.workdir_path)}[/yellow]", highlight=False)
        err.print(f"Run the same command to continue: {_this_command()}", highlight=False)


def _render_where_it_stands(workdir: Path) -> None:
    """After a failed run: the campaign's status table, if it can be read from here (S3 checkpoints
    behind a storage block's credentials cannot: those never leave the flow)."""
    from pretrain.views.status import campaign_status, render

    if not (workdir / "ledger.json").exists():
        return
    try:
        render(campaign_status(workdir))
    except Exception as e:  # noqa: BLE001 - the run's own error was printed already
        err.print(
            f"(cannot show the campaign's status from here: {e}; `pretrain status --workdir {workdir}` "
            "with the storage's credentials in the environment shows it)",
            highlight=False,
        )


def _this_command() -> str:
    """This invocation, to copy and paste (the same command resumes a campaign)."""
    return shlex.join(["pretrain", *sys.argv[1:]])


@app.command()
def status(
    workdir: Path | None = typer.Option(
        None,
        "--workdir",
        "-w",
        help="The campaign's workdir (default: the one campaign in ./runs, where `pretrain run` puts it).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    watch: bool = typer.Option(
        False,
        "--watch",
        help="Follow a running campaign's training (step, loss, tokens/s, "
        "ETA, restarts, newest checkpoint) until it stops running, then show the table.",
    ),
    interval: float = typer.Option(
        5.0,
        "--interval",
        min=0.1,
        help="With --watch: seconds between looks (and between lines when not on a terminal).",
    ),
) -> None:
    """Show a campaign's stages, checkpoints, attempts, restarts and MLflow runs."""
    from pretrain.cli.workdir_lookup import pick_workdir
    from pretrain.state.ledger import LedgerError
    from pretrain.views.status import NoCampaign, campaign_status, render

    with refused(NoCampaign):
        workdir = pick_workdir(workdir)
    if watch:
        from pretrain.cli.watch import watch_campaign

        with refused(NoCampaign, LedgerError):
            watch_campaign(workdir, interval)
    with refused(NoCampaign, LedgerError):
        st = campaign_status(workdir)
    if as_json:
        sys.stdout.write(json.dumps(st, indent=2) + "\n")
    else:
        render(st)


@app.command("recover-ledger")
def recover_ledger(
    workdir: Path = typer.Option(..., "--workdir", "-w", help="The campaign's workdir."),
) -> None:
    """Replace a damaged ledger.json with its intact previous generation (the damaged one is kept)."""
    from pretrain.state.local import LedgerError
    from pretrain.state.local import recover_ledger as recover
    from pretrain.state.lock import CampaignBusy, campaign_lock

    with refused(LedgerError, CampaignBusy):
        if not workdir.is_dir():
            raise LedgerError(f"{workdir} is not a directory: give the campaign's workdir")
        with campaign_lock(workdir, workdir.name):  # never under a running campaign
            aside = recover(workdir)
    sys.stdout.write(
        f"restored {workdir / 'ledger.json'} from its previous generation; the damaged file is kept as {aside}\n"
    )


# ---- one checkpoint: eval / export ---------------------------------------------------------
_CHECKPOINT_HELP = (
    "A checkpoint: <stage location>/step_XXXXXXXX, a local directory or an s3:// URL; or a campaign's "
    "workdir: its newest good checkpoint"
)
_WORKDIR = typer.Option(
    None,
    "--workdir",
    "-w",
    help="A campaign's workdir: take its newest good checkpoint (as giving the workdir for CHECKPOINT).",
)
_DATA_DIR = typer.Option(
    None, "--data-dir", help="Prepared data set (tokenizer, val split); default: the one the checkpoint records."
)
_SPEC = typer.Option(
    None, "--spec", help="Campaign spec YAML: model, data dir and S3 options for checkpoints that do not record them."
)
_S3_ENDPOINT = typer.Option(
    None, "--s3-endpoint-url", help="S3-compatible endpoint (MinIO, SeaweedFS…); credentials from the AWS environment."
)
_S3_REGION = typer.Option(None, "--s3-region", help="S3 region.")


@contextmanager
def _checkpoint_errors():
    """A refused checkpoint exits 1 listing its problems; missing or wrong input exits 2."""
    from pretrain.checkpoints.info import CheckpointInfoError, CheckpointRejected
    from pretrain.spec.campaign import SpecError
    from trainer.storage import StorageError

    try:
        yield
    except CheckpointRejected as e:
        err.print(f"checkpoint {e.location} is not usable:", highlight=False)
        for problem in e.problems:
            err.print(f"  - {problem}", highlight=False)
        raise typer.Exit(1)
    except (SpecError, CheckpointInfoError, StorageError, FileExistsError) as e:
        raise fail(str(e)) from None


def _checkpoint_of(checkpoint: str | None, workdir: Path | None) -> str:
    """The checkpoint a command means: ``checkpoint``, unless it (or ``workdir``) names a campaign's
    workdir, or neither is given (the campaign here): then that campaign's newest good checkpoint."""
    from pretrain.cli.workdir_lookup import good_checkpoint, is_campaign_workdir
    from pretrain.state.ledger import LedgerError
    from pretrain.views.status import NoCampaign

    if checkpoint is not None and workdir is not None:
        raise fail(f"give a checkpoint or --workdir, not both ({checkpoint} and --workdir {workdir})")
    if checkpoint is not None and not is_campaign_workdir(checkpoint):
        return checkpoint
    with refused(NoCampaign, LedgerError):
        return good_checkpoint(Path(checkpoint) if checkpoint is not None else workdir)


def _describe(checkpoint: str, data_dir, spec, s3_endpoint_url, s3_region, seq_len=None):
    """The checkpoint's CheckpointInfo, from its manifest and the options given."""
    from pretrain.checkpoints.info import describe, spec_overrides
    from pretrain.spec.file import load_spec
    from pretrain.state.locations import s3_options

    with _checkpoint_errors():
        given = spec_overrides(load_spec(spec), data_dir) if spec else {"data_dir": data_dir}
        options = s3_options(s3_endpoint_url, s3_region) or given.get("options")
        return describe(
            checkpoint,
            options=options,
            model=given.get("model"),
            data_dir=given["data_dir"],
            seq_len=seq_len,
            cache_dir=given.get("cache_dir"),
        )


@app.command("eval")
def eval_checkpoint(
    checkpoint: str | None = typer.Argument(
        None,
        help=f"{_CHECKPOINT_HELP} (default: the newest good one of the "
        "campaign in ./runs, where `pretrain run` puts it).",
    ),
    workdir: Path | None = _WORKDIR,
    data_dir: Path | None = _DATA_DIR,
    spec: str | None = _SPEC,
    seq_len: int | None = typer.Option(
        None, "--seq-len", min=2, help="Tokens per evaluation window; default: the stage's training seq_len."
    ),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, help="Windows per forward pass (default 8)."),
    max_batches: int | None = typer.Option(
        None,
        "--max-batches",
        min=1,
        help="Batches evaluated at most (default: the spec's validation.eval_batches default, 16).",
    ),
    s3_endpoint_url: str | None = _S3_ENDPOINT,
    s3_region: str | None = _S3_REGION,
    tracking_uri: str | None = typer.Option(
        None, "--tracking-uri", help="MLflow tracking URI for --run-id (default: MLflow's, e.g. MLFLOW_TRACKING_URI)."
    ),
    run_id: str | None = typer.Option(
        None, "--run-id", help="Log the metrics to this MLflow run at the checkpoint's step."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Validate a checkpoint and print its val loss, perplexity and accuracy; a bad one is refused (exit 1)."""
    from pretrain.checkpoints.evaluation import evaluate_checkpoint

    if tracking_uri and not run_id:
        raise fail("--tracking-uri needs --run-id (the run to log the metrics to)")
    checkpoint = _checkpoint_of(checkpoint, workdir)
    info = _describe(checkpoint, data_dir, spec, s3_endpoint_url, s3_region, seq_len)
    if run_id:  # a wrong run fails before the evaluation, not after
        from mlflow.exceptions import MlflowException

        from pretrain.cli.errors import fail_fast_on_mlflow

        fail_fast_on_mlflow()
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
        except MlflowException as e:
            raise fail(f"cannot log to MLflow run {run_id}: {e.message}") from None
    with _checkpoint_errors():
        sizes = {k: v for k, v in (("batch_size", batch_size), ("max_batches", max_batches)) if v is not None}
        metrics = evaluate_checkpoint(info, **sizes, tracking_uri=tracking_uri, run_id=run_id)
    if as_json:
        sys.stdout.write(json.dumps({"checkpoint": info.location, "step": info.step, **metrics}, indent=2) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    sys.stdout.write(f"{info.location} (step {info.step}): valid\n")
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in metrics.items():
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    Console().print(table)
    if run_id:
        Console().print(f"logged to MLflow run {run_id} at step {info.step}")


@app.command("export")
def export(
    checkpoint: str | None = typer.Argument(None, help=f"{_CHECKPOINT_HELP}. With --workdir, give OUT alone."),
    out: Path | None = typer.Argument(None, help="Directory to create (written atomically)."),
    workdir: Path | None = _WORKDIR,
    data_dir: Path | None = _DATA_DIR,
    spec: str | None = _SPEC,
    s3_endpoint_url: str | None = _S3_ENDPOINT,
    s3_region: str | None = _S3_REGION,
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace OUT if it is an earlier export (has pretrain.json); anything else is refused.",
    ),
) -> None:
    """Export a checkpoint as a Hugging Face GPT-2 model directory (safetensors, config, tokenizer)."""
    from pretrain.checkpoints.export_target import ExportRefused, check_out

    if out is None and workdir is not None and checkpoint is not None:  # `pretrain export OUT --workdir DIR`
        checkpoint, out = None, Path(checkpoint)
    if out is None:
        raise fail(
            "give the directory to export to: pretrain export CHECKPOINT OUT, or pretrain export OUT --workdir DIR"
        )
    checkpoint = _checkpoint_of(checkpoint, workdir)
    try:  # a wrong OUT is refused before the checkpoint is read
        check_out(out.expanduser().absolute(), checkpoint, overwrite)
    except FileExistsError as e:
        raise fail(str(e)) from None
    from pretrain.checkpoints.export import export_model

    info = _describe(checkpoint, data_dir, spec, s3_endpoint_url, s3_region)
    with _checkpoint_errors():
        try:
            path = export_model(info, out, overwrite=overwrite)
        except ExportRefused:
            raise  # its own message
        except OSError as e:  # no such parent, not writable, a file on the way, disk full
            raise fail(f"cannot write the export to {out}: {describe(e)}; give a writable directory") from None
    sys.stdout.write(f"exported step {info.step} of {info.location} to {path}\n")


@app.command("spec-schema")
def spec_schema() -> None:
    """Print the campaign spec's JSON schema (every field with its description)."""
    from pretrain.spec.campaign import CampaignSpec

    sys.stdout.write(json.dumps(CampaignSpec.model_json_schema(), indent=2) + "\n")


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from trainer.common.process import exit_now

    try:
        app()
    except SystemExit as e:  # how every command ends (click's standalone mode)
        if e.code == 130 and isinstance(getattr(e.__context__, "__cause__", None), KeyboardInterrupt):
            err.print("interrupted", highlight=False)  # typer ended a command Ctrl-C broke into, silently
        exit_now(e.code)  # without the teardown of every module imported (1.6 s after a campaign)
    exit_now(0)


if __name__ == "__main__":
    main()
