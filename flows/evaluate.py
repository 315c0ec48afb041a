"""Flow: evaluate a checkpoint on the validation split and log it to the stage's MLflow run."""

from __future__ import annotations

from prefect import flow

from flows.locking import holds_campaign_lock
from pretrain.ledger import Ledger
from pretrain.spec import CampaignSpec
from tasks.evaluation import evaluate_stage_checkpoint
from tasks.tracking import log_stage_evaluation


@flow(name="evaluate")
@holds_campaign_lock
def evaluate(spec: CampaignSpec, stage: str, path: str, step: int) -> dict:
    index = spec.stage_index(stage)
    stage_spec = spec.stages[index]
    metrics = evaluate_stage_checkpoint(spec, path, stage_spec.seq_len)
    ledger = Ledger.open(spec)
    log_stage_evaluation(spec, ledger.stage(stage).mlflow_run_id, ledger.record.mlflow.parent_run_id,
                         metrics, step, spec.step_offset(index) + step)
    ledger.set_eval(stage, {**metrics, "step": step})
    return metrics
