"""``pretrain report``: a campaign's pictures (loss vs tokens, goodput) and an HTML page, on demand."""

from __future__ import annotations

from pathlib import Path

import typer

from pretrain.cli.errors import describe, refused


def report(
    workdir: Path | None = typer.Option(
        None,
        "--workdir",
        "-w",
        help="The campaign's workdir (default: the one campaign in ./runs, where `pretrain run` puts it).",
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Where to write the files (default: <workdir>/report)."),
) -> None:
    """Write the campaign's loss and goodput pictures (PNG) and an HTML page with its report."""
    from pretrain.cli.workdir_lookup import pick_workdir
    from pretrain.state.ledger import LedgerError
    from pretrain.views.report import write_report_files
    from pretrain.views.status import NoCampaign

    with refused(NoCampaign, LedgerError, OSError):
        workdir = pick_workdir(workdir)
        target = out or Path(workdir) / "report"
        try:
            files = write_report_files(workdir, target)
        except (FileExistsError, NotADirectoryError, PermissionError, FileNotFoundError) as e:
            raise OSError(
                f"cannot write the report to {target}: {describe(e)}; give --out a directory that can be written"
            ) from None
    for what, path in files.items():
        typer.echo(f"{what}: {path}")
