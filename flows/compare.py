"""Flow: campaigns side by side (``pretrain compare``'s table) as a Prefect artifact."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from pretrain.tracking.store import shared_tracking_uri
from pretrain.views.compare import compare
from pretrain.views.compare_table import markdown

ARTIFACT_KEY = "campaign-comparison"


@flow(name="compare-campaigns")
def compare_campaigns(campaigns: list[str], tracking_uri: str | None = None) -> list[dict]:
    """Compare ``campaigns`` (workdirs, MLflow campaign run ids or campaign names) from MLflow:
    the table of ``pretrain compare`` as the ``campaign-comparison`` markdown artifact.
    ``tracking_uri``: where to find run ids and names (default: MLFLOW_TRACKING_URI, else
    ./mlflow.db of the flow's working directory)."""
    summaries = compare(campaigns, tracking_uri or shared_tracking_uri())
    table = markdown(summaries)
    create_markdown_artifact(
        table,
        key=ARTIFACT_KEY,
        description=f"{len(summaries)} campaigns compared (eval loss, tokens, goodput, faults, differing parameters)",
    )
    get_run_logger().info("compared %s", ", ".join(s.campaign for s in summaries))
    return [s.to_json() for s in summaries]
