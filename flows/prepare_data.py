"""Flow: raw text → tokenizer → packed token shards with a manifest (idempotent)."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from blocks.references import resolve_campaign
from pretrain.ledger import Ledger
from pretrain.lock import campaign_lock
from pretrain.spec import CampaignSpec
from tasks.data import prepare_dataset


@flow(name="prepare-data", log_prints=True)
def prepare_data(spec: CampaignSpec | None = None, spec_path: str | None = None, workdir: str | None = None) -> dict:
    """Prepare the campaign's data set: give ``spec`` inline or ``spec_path`` (YAML or
    ``builtin:tiny``); ``workdir`` overrides where the campaign keeps its state. Refused
    (``CampaignBusy``) while another run of the campaign holds its workdir."""
    spec = resolve_campaign(spec, spec_path, workdir)
    with campaign_lock(spec.workdir_path, spec.name, flow_run.get_id()):  # the campaign's own, when it calls this
        record = prepare_dataset(spec)
        Ledger.open(spec).set_data(record)
    return record.to_json()
