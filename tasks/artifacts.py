"""Prefect artifacts of a campaign, each under a stable key so it versions across runs:

- ``campaign-report-<campaign>``  markdown: stages, attempts, goodput, checkpoints, node check, time lost per cause
  (at the campaign's end, with its pictures: ``publish_goodput``)
- ``checkpoints-<campaign>``      table: every stored checkpoint with its verdict and eval loss
- ``training-progress-<campaign>`` progress (0-100 %) over all stages, updated while a job trains
  (``tasks.training_progress``)
- ``data-preparation-<campaign>`` progress (0-100 %) of data preparation (``tasks.data_progress``)
- ``mlflow-run-<campaign>``       link to the campaign's MLflow parent run
- ``node-check-<campaign>``       table: the node health check (made by ``tasks.cluster``)
- ``kubernetes-manifests-<campaign>`` markdown: every stage's manifests (made by ``tasks.cluster``)
"""

from __future__ import annotations

import re
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from pretrain.redact import redact
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from pretrain.views.goodput import ALL
from pretrain.views.report import campaign_report, checkpoint_rows
from tasks.tracking import tracker_for


def artifact_key(kind: str, campaign: str) -> str:
    """``<kind>-<campaign>`` in the alphabet Prefect allows for keys (lowercase letters, digits, dashes)."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", f"{kind}-{campaign}".lower())).strip("-")


def publish_reports(spec: CampaignSpec, status: dict | None = None, images: dict[str, str] | None = None) -> None:
    """The checkpoint table and the campaign report, as they stand now (``status``: the
    campaign's status, when the caller has just computed it; ``images``: pictures to embed)."""
    credentials = spec.credentials.s3_options()  # for reading the checkpoints; the reports are redacted
    rows = checkpoint_rows(spec.workdir_path, credentials)
    create_table_artifact(
        key=artifact_key("checkpoints", spec.name),
        table=rows or [{"stage": None, "step": None}],
        description=f"Checkpoints of campaign {spec.name}: verdict, good pointer, eval loss",
    )
    create_markdown_artifact(
        key=artifact_key("campaign-report", spec.name),
        markdown=campaign_report(spec.workdir_path, credentials, status, images),
        description=f"Campaign {spec.name}: stages, attempts, checkpoints, node check, time lost",
    )


def goodput_metrics(goodput: dict) -> dict[str, float]:
    """MLflow metrics of a goodput split: ``goodput`` (a fraction) and ``goodput_<category>_s``."""
    if not goodput.get("known"):
        return {}
    return {
        **({"goodput": goodput["goodput"]} if goodput["goodput"] is not None else {}),
        **{f"goodput_{c}_s": goodput["parts_s"].get(c, 0.0) for c in ALL},
        "goodput_wall_s": goodput["wall_s"],
    }


def publish_goodput(spec: CampaignSpec, status: dict, run_id: str | None) -> dict[str, str]:
    """At the campaign's end: its pictures (loss vs tokens, goodput) into ``<workdir>/report``,
    and the goodput metrics, ``goodput.json`` and the pictures on the MLflow parent run.
    Returns the pictures to embed in the report (title → URL). MLflow away: a warning; the
    numbers stay in the ledger (``pretrain status``, ``pretrain report``)."""
    from pretrain.views.plots import write_plots  # matplotlib: only at the end

    logger = get_run_logger()
    layout = spec.layout
    goodput = {"campaign": status["goodput"], "stages": {s["name"]: s["goodput"] for s in status["stages"]}}
    try:
        pictures = write_plots(Ledger.read(layout).record, layout, goodput, layout.root / "report")
    except Exception as err:  # noqa: BLE001 - a picture never fails a finished campaign
        logger.warning(
            "cannot draw the campaign's pictures (%s); `pretrain report --workdir %s` draws them later",
            err,
            spec.workdir_path,
        )
        pictures = []
    if run_id:
        try:
            tracker = tracker_for(spec)
            tracker.check()  # one quick request: MLflow's own retries would take minutes
            tracker.log_values(run_id, goodput_metrics(goodput["campaign"]), step=0)
            tracker.client.log_dict(run_id, goodput, "goodput.json")
            for png in pictures:
                tracker.client.log_artifact(run_id, str(png), "report")
        except Exception as err:  # noqa: BLE001 - MLflow away: the ledger keeps the numbers
            logger.warning(
                "cannot log the goodput to MLflow run %s (%s); `pretrain status --workdir %s` shows it",
                run_id,
                redact(str(err))[:300],
                spec.workdir_path,
            )
    return {png.stem.replace("_", " "): Path(png).resolve().as_uri() for png in pictures}


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> tuple[str, str]:
    """(URL of the run's page, how to open it). A local database has no server: the URL is the one
    ``mlflow ui --backend-store-uri <uri>`` serves by default."""
    if tracking_uri.startswith(("http://", "https://")):
        return (
            f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}",
            f"MLflow server {tracking_uri}",
        )
    return (
        f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}",
        f"start the MLflow UI first: mlflow ui --backend-store-uri {tracking_uri}",
    )


def link_mlflow_run(spec: CampaignSpec, experiment_id: str, run_id: str) -> None:
    url, how = map(redact, mlflow_run_url(spec.tracking_uri, experiment_id, run_id))
    create_link_artifact(
        key=artifact_key("mlflow-run", spec.name),
        link=url,
        link_text=f"MLflow run of {spec.name}",
        description=f"Campaign {spec.name}'s MLflow parent run {run_id} ({how})",
    )
