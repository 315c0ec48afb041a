"""``pretrain`` command line: run a campaign, show where one stands."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Fault-tolerant LLM pre-training campaigns orchestrated by Prefect.")
err = Console(stderr=True)


@app.command()
def run(
    spec: Optional[str] = typer.Argument(None, help="Campaign spec YAML (default: the built-in tiny demo)."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", "-w", help="Where the campaign keeps its state (overrides the spec)."),
) -> None:
    """Run a campaign, or resume it: the same command after any crash continues where it stopped."""
    from pretrain.spec import SpecError, load_spec

    try:
        campaign = load_spec(spec or "builtin:tiny").with_workdir(workdir)
    except SpecError as e:
        err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
        raise typer.Exit(2)
    from flows.campaign import pretrain_campaign
    from pretrain.ledger import CampaignMismatch
    from pretrain.status import campaign_status, render

    try:
        pretrain_campaign(spec=campaign)
    except CampaignMismatch as e:
        err.print(f"error: {e}", highlight=False)
        raise typer.Exit(2)
    except Exception as e:  # noqa: BLE001 - report, show where the campaign stands, exit non-zero
        err.print(f"[red]campaign failed:[/red] {e}", highlight=False)
        if (campaign.workdir_path / "ledger.json").exists():
            render(campaign_status(campaign.workdir_path))
        raise typer.Exit(1)
    render(campaign_status(campaign.workdir_path))


@app.command()
def status(
    workdir: Path = typer.Option(..., "--workdir", "-w", help="The campaign's workdir."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Show a campaign's stages, checkpoints, attempts, restarts and MLflow runs."""
    from pretrain.status import NoCampaign, campaign_status, render

    try:
        st = campaign_status(workdir)
    except NoCampaign as e:
        err.print(f"error: {e}", highlight=False)
        raise typer.Exit(2)
    if as_json:
        sys.stdout.write(json.dumps(st, indent=2) + "\n")
    else:
        render(st)


@app.command("spec-schema")
def spec_schema() -> None:
    """Print the campaign spec's JSON schema (every field with its description)."""
    from pretrain.spec import CampaignSpec

    sys.stdout.write(json.dumps(CampaignSpec.model_json_schema(), indent=2) + "\n")


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    app()


if __name__ == "__main__":
    main()
