"""Flow: the validation gate on one checkpoint; only a validated checkpoint becomes the
stage's good one (and its resume point). A checkpoint the gate already judged keeps its verdict."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.locking import holds_campaign_lock
from pretrain.run.jobs import checkpoint_store
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.locations import client_options
from tasks.checkpoints import check_checkpoints
from trainer.checkpoint.store import CheckpointStore


class CheckpointInvalid(RuntimeError):
    """A checkpoint failed validation."""


@flow(name="validate-checkpoint")
@holds_campaign_lock
def validate_checkpoint(spec: CampaignSpec, stage: str, path: str) -> dict:
    stage_index = spec.stage_index(stage)
    _, step = CheckpointStore.of_step(path, client_options(spec))
    record = checkpoint_store(spec, stage).verdict(step)
    if record is None:
        (record,) = check_checkpoints(spec, stage_index, [step])  # records the verdict and emits its event
    if record["verdict"] == "unjudged":  # the gate timed out or could not reach the checkpoint
        raise CheckpointInvalid(
            f"checkpoint {path} of stage {stage} could not be validated now: "
            + "; ".join(record["problems"])
            + ". Run the flow again."
        )
    if record["verdict"] != "good":
        raise CheckpointInvalid(
            f"checkpoint {path} of stage {stage} failed validation: " + "; ".join(record["problems"])
        )
    get_run_logger().info("stage %s: checkpoint %s is good", stage, path)
    return record
