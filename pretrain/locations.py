"""Where a campaign's checkpoints and data are, and the storage options its S3 clients take.
Depends on the spec alone, so the ledger, the campaign guard and the data record can use it
without importing the job builder (``pretrain.jobs``) that depends on them."""

from __future__ import annotations

from pretrain.layout import CampaignLayout
from pretrain.spec import CampaignSpec


def checkpoint_location(spec: CampaignSpec, stage: str) -> str:
    uri = spec.checkpoint.uri
    return f"{uri.rstrip('/')}/{stage}" if uri else str(CampaignLayout(spec.workdir_path).ckpt_dir(stage))


def s3_options(endpoint_url: str | None = None, region: str | None = None) -> dict:
    """Storage options for an S3 checkpoint location (credentials come from the AWS environment)."""
    return {k: v for k, v in (("endpoint_url", endpoint_url), ("region", region)) if v}


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
