"""Where a campaign's checkpoints and data are, and the storage options its S3 clients take.
Depends on the spec alone, so the ledger, the campaign guard and the data record can use it
without importing the job builder (``pretrain.run.jobs``) that depends on them."""

from __future__ import annotations

from pathlib import Path

from pretrain.spec.campaign import CampaignSpec
from pretrain.spec.layout import CampaignLayout
from trainer.job.config import s3_options


def checkpoint_location(spec: CampaignSpec, stage: str) -> str:
    uri = spec.checkpoint.uri
    return f"{uri.rstrip('/')}/{stage}" if uri else str(spec.layout.ckpt_dir(stage))


def recorded_checkpoints(layout: CampaignLayout, stage: str, recorded: str) -> tuple[str, str | None]:
    """Where to read the checkpoints of ``stage`` that the ledger records at ``recorded``, and a
    note when the campaign was moved or copied: the default place of another directory
    (``<old workdir>/checkpoints/<stage>``) is read in this workdir instead."""
    here, path = layout.ckpt_dir(stage), Path(recorded)
    if "://" in recorded or path == here or path.parts[-2:] != ("checkpoints", stage) or not here.is_dir():
        return recorded, None
    return str(here), (
        f"the ledger records this stage's checkpoints in {path.parent.parent}: the campaign was moved or "
        f"copied from there; those in {layout.root} are shown (the next `pretrain run` records the new place)"
    )


def storage_options(spec: CampaignSpec) -> dict:
    return s3_options(spec.checkpoint.s3_endpoint_url, spec.checkpoint.s3_region)


def client_options(spec: CampaignSpec) -> dict:
    """Storage options plus the credentials of the spec's blocks: for S3 clients in this process
    only (``storage_options`` is what may be written down: job files, ledger, gate requests)."""
    return {**storage_options(spec), **spec.credentials.s3_options()}


def data_options(spec: CampaignSpec) -> dict:
    """Storage options for S3 sources and data sets (the data section's endpoint, else the checkpoints')."""
    d, c = spec.data, spec.checkpoint
    return s3_options(d.s3_endpoint_url or c.s3_endpoint_url, d.s3_region or c.s3_region)


def data_client_options(spec: CampaignSpec) -> dict:
    """``data_options`` plus the blocks' credentials: for S3 clients in this process only."""
    return {**data_options(spec), **spec.credentials.s3_options()}
