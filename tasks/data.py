"""Data preparation task: prepare (or reuse) the campaign's data set and check that it is the one
the campaign's checkpoints were trained on."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.data.campaign import data_record, data_root, kept_flat_data
from pretrain.data.identity import DataChanged, refuse_changed_data, trained_stages
from pretrain.data.prepare.pipeline import prepare
from pretrain.data.prepare.progress import PrepProgress, ProgressCallback
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from pretrain.state.locations import data_client_options
from pretrain.state.schema import DataRecord
from trainer.data.cache import fetch_manifest
from trainer.data.manifest import DataError


@task(name="prepare-dataset", cache_policy=NO_CACHE)
def prepare_dataset(spec: CampaignSpec, progress: ProgressCallback | None = None) -> DataRecord:
    """The campaign's data set, prepared (or reused when its inputs are unchanged); raises
    :class:`DataChanged` when stages were trained on another one (the ledger keeps its record).
    ``progress`` receives where preparation is."""
    logger = get_run_logger()
    record = Ledger.open(spec).record
    kept = kept_flat_data(spec, record)
    if kept is not None:
        logger.info(
            "campaign prepared by an earlier release: keeps its data set in %s (fingerprint %s)",
            kept.location,
            kept.fingerprint,
        )
        if progress is not None:
            progress(PrepProgress("done"))
        return kept
    prepared = prepare(
        spec.data,
        data_root(spec),
        work=spec.layout.data_work,
        s3_options=data_client_options(spec),
        log=logger.info,
        progress=progress,
    )
    old = None
    if record.data is not None and record.data.fingerprint != prepared.get("fingerprint") and trained_stages(record):
        try:
            old = fetch_manifest(record.data.location, data_client_options(spec))[2]
        except (DataError, OSError) as err:
            logger.warning("cannot read the manifest of the data set the campaign trained on: %s", err)
    try:
        refuse_changed_data(record, prepared, old)
    except DataChanged as err:
        logger.error("%s", err)
        raise
    return data_record(prepared)
