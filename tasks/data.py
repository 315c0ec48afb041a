"""Data preparation task."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.dataprep import prepare
from pretrain.dataset.progress import PrepProgress, ProgressCallback
from pretrain.layout import CampaignLayout
from pretrain.spec import CampaignSpec


@task(name="prepare-dataset", cache_policy=NO_CACHE)
def prepare_dataset(spec: CampaignSpec, progress: ProgressCallback | None = None) -> dict:
    """Tokenizer + packed shards in ``<workdir>/data`` (reused when inputs are unchanged);
    ``progress`` receives where preparation is."""
    logger = get_run_logger()
    manifest = prepare(spec.data, CampaignLayout(spec.workdir_path).data_dir, log=logger.info)
    if progress is not None:
        progress(PrepProgress("done", tokens=sum(manifest["tokens"].values()), documents=sum(manifest["documents"].values())))
    return {k: v for k, v in manifest.items() if k != "splits"}
