"""Flow: evaluate one checkpoint on demand (the target of the ``pretrain.checkpoint.good`` trigger).

PLACEHOLDER: the real evaluation flow is being written separately; this stub only fixes the
deployment's entrypoint, flow name and signature so ``prefect deploy --all`` and the trigger work.
"""

from __future__ import annotations

from prefect import flow, get_run_logger


@flow(name="evaluate-checkpoint")
def evaluate_checkpoint(checkpoint: str, data_dir: str | None = None) -> dict:
    """Evaluate ``checkpoint`` (a local path or s3:// URI) on the validation split in ``data_dir``."""
    get_run_logger().info("evaluate-checkpoint placeholder: checkpoint %s, data %s", checkpoint, data_dir)
    return {"checkpoint": checkpoint, "data_dir": data_dir}
