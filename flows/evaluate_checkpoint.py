"""Flow: evaluate any checkpoint with no campaign spec (the flow behind ``pretrain eval``).

describe (from the checkpoint's manifest) → validate (a bad checkpoint fails the flow, naming
the problems) → val loss / perplexity / accuracy → optionally log them to an MLflow run at the
checkpoint's step. Read-only: writes nothing next to the checkpoint.
"""

from __future__ import annotations

from prefect import flow

from pretrain.checkpoints.evaluation import DEFAULT_BATCHES
from pretrain.state.locations import s3_options
from tasks.evaluation import describe_checkpoint, log_evaluation, measure_checkpoint, require_valid_checkpoint
from trainer.evaluate import EVAL_BATCH_SIZE


@flow(name="evaluate-checkpoint")
def evaluate_checkpoint(
    checkpoint: str,
    data_dir: str | None = None,
    seq_len: int | None = None,
    s3_endpoint_url: str | None = None,
    s3_region: str | None = None,
    tracking_uri: str | None = None,
    run_id: str | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    max_batches: int = DEFAULT_BATCHES,
) -> dict:
    """``checkpoint``: a ``…/step_XXXXXXXX`` directory or ``s3://`` URL. ``data_dir``
    overrides the data set the checkpoint records; ``run_id`` (with ``tracking_uri``, default
    MLflow's) names a run to log the metrics to. Returns the step and the metrics."""
    info = describe_checkpoint(checkpoint, s3_options(s3_endpoint_url, s3_region), data_dir, seq_len)
    require_valid_checkpoint(info)
    metrics = measure_checkpoint(info, batch_size, max_batches)
    if run_id:
        log_evaluation(tracking_uri, run_id, metrics, info.step)
    return {"checkpoint": info.location, "step": info.step, **metrics}
