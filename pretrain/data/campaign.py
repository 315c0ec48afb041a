"""Which data set a campaign trains on and where it is: the ledger's data record.

Data preparation records the data set's fingerprint and location (``<root>/<fingerprint>/``,
local or on S3) in the ledger; jobs, the gate, evaluation and the data-changed check read them
from there, never from a fixed directory. A campaign of the release before (a ledger whose data
record has no location, data prepared flat in ``<workdir>/data``) keeps using that data set.
"""

from __future__ import annotations

import os
from pathlib import Path

from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from pretrain.state.locations import data_client_options
from pretrain.state.schema import CampaignRecord, DataRecord
from trainer.data.cache import local_data_dir
from trainer.data.manifest import DataError, read_manifest

SUMMARY_LEFT_OUT = ("splits", "sources", "reused")  # in the manifest at the location; the ledger stays small


def data_root(spec: CampaignSpec) -> str:
    """Where the campaign's data sets live, each in its ``<fingerprint>/`` directory."""
    return spec.data.uri.rstrip("/") if spec.data.uri else str(spec.layout.data_dir)


def data_record(prepared: dict) -> DataRecord:
    """The ledger's record of a data set preparation returned (its manifest, ``location``, ``reused``)."""
    return DataRecord(**{k: v for k, v in prepared.items() if k not in SUMMARY_LEFT_OUT})


def flat_data_set(spec: CampaignSpec) -> DataRecord | None:
    """The data set of the release before, prepared flat in ``<workdir>/data`` (None if there is none)."""
    flat = spec.layout.data_dir
    try:
        manifest = read_manifest(flat)
    except DataError:
        return None
    return data_record({**manifest, "location": str(flat)})


def kept_flat_data(spec: CampaignSpec, record: CampaignRecord) -> DataRecord | None:
    """A campaign of the release before keeps its data set (its ledger's data record has no
    location; the data set is flat in ``<workdir>/data``): None for any other campaign."""
    if record.data is None or record.data.location:
        return None
    return flat_data_set(spec)


def campaign_data(spec: CampaignSpec) -> DataRecord:
    """The data set the campaign trains on: the ledger's record, or the release before's flat one."""
    ledger = Ledger.of_spec(spec)
    record = ledger.record.data if ledger is not None else None
    if record is not None and record.location:
        return record
    flat = flat_data_set(spec)
    if flat is None:
        raise DataError(
            f"campaign {spec.name!r} has no prepared data set (none recorded in its ledger, none in "
            f"{spec.layout.data_dir}): run it (`pretrain run`) or prepare the data "
            "first (`pretrain data prepare`)"
        )
    return flat


def validation_data(spec: CampaignSpec) -> tuple[Path, int]:
    """A local directory with the campaign's data set (its tokenizer and validation split fetched
    into the node cache when it is on S3) and its vocabulary size: what the gate and the
    orchestrator's evaluation read."""
    record = campaign_data(spec)
    local = local_data_dir(
        record.location,
        spec.layout.data_cache,
        data_client_options(spec),
        splits=("val",),
        fingerprint=record.fingerprint,
        session=f"orchestrator-{os.getpid()}",
    )
    return local, record.vocab_size or read_manifest(local)["vocab_size"]
