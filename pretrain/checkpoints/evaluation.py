"""Standalone evaluation of one checkpoint: validate it, refuse it if bad, else measure it.

Used by ``pretrain eval`` and the ``evaluate-checkpoint`` flow. Read-only: unlike the
campaign's validation gate it writes no verdict next to the checkpoint.
"""

from __future__ import annotations

from pretrain.checkpoints.info import CheckpointInfo, CheckpointRejected
from pretrain.spec.checkpoints import ValidationSpec
from trainer.evaluate import EVAL_BATCH_SIZE, Verdict, evaluate, validate

DEFAULT_BATCHES = ValidationSpec.model_fields["eval_batches"].default  # with no spec: the spec's default


def require_valid(info: CheckpointInfo) -> Verdict:
    """The checkpoint's verdict; raises :class:`CheckpointRejected` naming the problems."""
    verdict = validate(info.location, info.model, info.options)
    if not verdict.ok:
        raise CheckpointRejected(info.location, verdict.problems)
    return verdict


def measure(info: CheckpointInfo, batch_size: int, max_batches: int) -> dict:
    """Validation loss, perplexity, next-token accuracy (and tokens scored) of a valid checkpoint."""
    return evaluate(
        info.location,
        info.model,
        info.data_dir,
        info.seq_len,
        batch_size=batch_size,
        max_batches=max_batches,
        options=info.options,
    )


def evaluate_checkpoint(
    info: CheckpointInfo,
    *,
    batch_size: int = EVAL_BATCH_SIZE,
    max_batches: int = DEFAULT_BATCHES,
    tracking_uri: str | None = None,
    run_id: str | None = None,
) -> dict:
    """Validate, evaluate, and (with ``run_id``) log the metrics to that MLflow run at the
    checkpoint's step. Returns the metrics."""
    require_valid(info)
    metrics = measure(info, batch_size, max_batches)
    if run_id:
        from pretrain.tracking.runs import log_to_run  # mlflow takes seconds to import: only when logging

        log_to_run(tracking_uri, run_id, metrics, info.step)
    return metrics
