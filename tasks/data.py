"""Data preparation task."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.dataprep import prepare
from pretrain.layout import CampaignLayout
from pretrain.spec import CampaignSpec


@task(name="prepare-dataset", cache_policy=NO_CACHE)
def prepare_dataset(spec: CampaignSpec) -> dict:
    """Tokenizer + packed shards in ``<workdir>/data`` (reused when inputs are unchanged)."""
    logger = get_run_logger()
    manifest = prepare(spec.data, CampaignLayout(spec.workdir_path).data_dir, log=logger.info)
    return {k: v for k, v in manifest.items() if k != "splits"}
