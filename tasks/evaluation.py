"""Evaluation task: validation loss / perplexity / accuracy of a checkpoint."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.jobs import model_config, storage_options
from pretrain.layout import CampaignLayout
from pretrain.spec import CampaignSpec
from trainer.data import read_manifest
from trainer.evaluate import evaluate


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE)
def evaluate_checkpoint(spec: CampaignSpec, path: str, seq_len: int) -> dict:
    data_dir = CampaignLayout(spec.workdir_path).data_dir
    metrics = evaluate(path, model_config(spec, read_manifest(data_dir)["vocab_size"]), data_dir, seq_len,
                       options=storage_options(spec))
    get_run_logger().info("evaluation of %s: %s", path, {k: round(v, 4) for k, v in metrics.items()})
    return metrics
