"""Evaluation tasks: validation loss / perplexity / accuracy of a checkpoint."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.checkpoints.evaluation import measure, require_valid
from pretrain.checkpoints.info import CheckpointInfo, CheckpointRejected, describe
from pretrain.data.campaign import validation_data
from pretrain.run.jobs import model_config
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.locations import client_options
from pretrain.tracking.runs import log_to_run
from tasks.tracking import MLFLOW_RETRIES
from trainer.evaluate import evaluate


@task(name="evaluate-stage-checkpoint", cache_policy=NO_CACHE)
def evaluate_stage_checkpoint(spec: CampaignSpec, path: str, seq_len: int) -> dict:
    """Validation loss, perplexity and accuracy of a stage's checkpoint (``validation.eval_batches`` batches)."""
    data_dir, vocab = validation_data(spec)
    metrics = evaluate(
        path,
        model_config(spec, vocab),
        data_dir,
        seq_len,
        max_batches=spec.validation.eval_batches,
        options=client_options(spec),
    )
    get_run_logger().info("evaluation of %s: %s", path, {k: round(v, 4) for k, v in metrics.items()})
    return metrics


# ---- standalone evaluation of any checkpoint (flows/evaluate_checkpoint.py) ---------------------
@task(name="describe-checkpoint", cache_policy=NO_CACHE)
def describe_checkpoint(location: str, options: dict, data_dir: str | None, seq_len: int | None) -> CheckpointInfo:
    """Model, data set and sequence length of the checkpoint, from its manifest (overridable)."""
    return describe(location, options=options, data_dir=data_dir, seq_len=seq_len)


@task(name="require-valid-checkpoint", cache_policy=NO_CACHE)
def require_valid_checkpoint(info: CheckpointInfo) -> dict:
    """Validate; a bad checkpoint fails the task with :class:`CheckpointRejected` naming why."""
    try:
        return require_valid(info).to_dict()
    except CheckpointRejected as err:
        get_run_logger().error("checkpoint %s is bad: %s", info.location, "; ".join(err.problems))
        raise


@task(name="measure-checkpoint", cache_policy=NO_CACHE)
def measure_checkpoint(info: CheckpointInfo, batch_size: int, max_batches: int) -> dict:
    metrics = measure(info, batch_size, max_batches)
    get_run_logger().info(
        "evaluation of %s (step %d): %s", info.location, info.step, {k: round(v, 4) for k, v in metrics.items()}
    )
    return metrics


@task(name="log-evaluation", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def log_evaluation(tracking_uri: str | None, run_id: str, metrics: dict, step: int) -> None:
    log_to_run(tracking_uri, run_id, metrics, step)
