"""Flow: raw text → tokenizer → packed token shards with a manifest (idempotent)."""

from __future__ import annotations

from prefect import flow

from blocks.references import resolve_campaign
from pretrain.ledger import Ledger
from pretrain.spec import CampaignSpec
from tasks.data import prepare_dataset


@flow(name="prepare-data", log_prints=True)
def prepare_data(spec: CampaignSpec | None = None, spec_path: str | None = None, workdir: str | None = None) -> dict:
    """Prepare the campaign's data set: give ``spec`` inline or ``spec_path`` (YAML or
    ``builtin:tiny``); ``workdir`` overrides where the campaign keeps its state."""
    spec = resolve_campaign(spec, spec_path, workdir)
    spec.workdir_path.mkdir(parents=True, exist_ok=True)
    summary = prepare_dataset(spec)
    Ledger.open(spec).set(data=summary)
    return summary
