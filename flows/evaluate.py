"""Flow: evaluate a stage's final checkpoint on the validation split, into the ledger (the
stage's end sends it to the MLflow runs: ``tasks.mlflow_sync``)."""

from __future__ import annotations

from prefect import flow

from flows.locking import holds_campaign_lock
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from tasks.evaluation import evaluate_stage_checkpoint


@flow(name="evaluate")
@holds_campaign_lock
def evaluate(spec: CampaignSpec, stage: str, path: str, step: int) -> dict:
    index = spec.stage_index(stage)
    stage_spec = spec.stages[index]
    metrics = evaluate_stage_checkpoint(spec, path, stage_spec.seq_len)
    Ledger.open(spec).set_eval(stage, {**metrics, "step": step})
    return metrics
