"""Flow: raw text → tokenizer → packed token shards with a manifest (idempotent)."""

from __future__ import annotations

from prefect import flow

from pretrain.ledger import Ledger
from pretrain.spec import CampaignSpec
from tasks.data import prepare_dataset


@flow(name="prepare-data", log_prints=True)
def prepare_data(spec: CampaignSpec) -> dict:
    summary = prepare_dataset(spec)
    Ledger.open(spec).set(data=summary)
    return summary
