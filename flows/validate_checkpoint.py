"""Flow: validate a checkpoint; only a validated checkpoint becomes the stage's good one."""

from __future__ import annotations

from prefect import flow, get_run_logger

from pretrain.ledger import Ledger
from pretrain.spec import CampaignSpec
from tasks.checkpoints import check_checkpoint
from tasks.events import checkpoint_verdict
from tasks.tracking import tracker_for


class CheckpointInvalid(RuntimeError):
    """A checkpoint failed validation."""


@flow(name="validate-checkpoint")
def validate_checkpoint(spec: CampaignSpec, stage: str, path: str) -> dict:
    record = check_checkpoint(spec, path)
    checkpoint_verdict(spec, stage, path, record)
    ledger = Ledger.open(spec)
    run_id = ledger.stage(stage)["mlflow_run_id"]
    if run_id:
        tracker_for(spec).set_tags(run_id, {f"verdict.{record['step']:08d}": record["verdict"]})
    if not record["ok"]:
        raise CheckpointInvalid(f"checkpoint {path} of stage {stage} failed validation: " + "; ".join(record["problems"]))
    ledger.update_stage(stage, good_checkpoint={"step": record["step"], "path": path})
    get_run_logger().info("stage %s: good checkpoint at step %s", stage, record["step"])
    return record
