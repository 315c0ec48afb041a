"""Flow: raw text → tokenizer → packed token shards with a manifest (idempotent)."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from blocks.references import resolve_campaign
from pretrain.data.prepare.progress import ProgressCallback
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import campaign_guard
from pretrain.state.ledger import Ledger
from pretrain.tracking.runs import describe_error
from tasks.data import prepare_dataset
from tasks.data_progress import PrepArtifact, fan_out
from tasks.tracking import log_data_set_input, tracker_for


@flow(name="prepare-data", log_prints=True)
def prepare_data(
    spec: CampaignSpec | None = None,
    spec_path: str | None = None,
    workdir: str | None = None,
    progress: ProgressCallback | None = None,
) -> dict:
    """Prepare the campaign's data set: give ``spec`` inline or ``spec_path`` (YAML or
    ``builtin:tiny``); ``workdir`` overrides where the campaign keeps its state; ``progress`` (in
    this process only, e.g. the CLI's display) also receives the progress the flow publishes as
    its ``data-preparation-<campaign>`` artifact. Refused (``CampaignBusy``) while another run
    of the campaign holds its workdir. The data set is logged to the campaign's MLflow run, if
    it has one yet, as a dataset input; MLflow being away never fails this flow."""
    spec = resolve_campaign(spec, spec_path, workdir)
    logger = get_run_logger()
    with campaign_guard(spec, flow_run.get_id()):  # the campaign's own, when it calls this
        record = prepare_dataset(spec, fan_out(PrepArtifact.for_campaign(spec.name, logger.warning), progress))
        ledger = Ledger.open(spec)
        ledger.set_data(record)
    summary = record.to_json()
    if run_id := ledger.record.mlflow.parent_run_id:
        spec = spec.with_tracking_uri(ledger.record.mlflow.tracking_uri)  # the campaign's store, from any directory
        away = tracker_for(spec).away()  # one quick request: MLflow's own retries take minutes
        state = None if away else log_data_set_input(spec, run_id, summary, return_state=True)
        if away or state.is_failed():
            logger.warning(
                "the data set is not logged to MLflow run %s (%s); the campaign goes on, and the next "
                "run of this flow logs it",
                run_id,
                f"MLflow does not answer: {away}" if away else describe_error(state.result(raise_on_failure=False)),
            )
    return summary
