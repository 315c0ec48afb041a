"""What ``pretrain run`` and ``pretrain data prepare`` refuse before they start anything (their
Prefect API server and the flow: ~10 s), from this machine alone: a workdir that cannot be made
or written, a damaged local ledger (or one of a newer release), the ledger of a campaign started
from another spec (or, for a campaign whose state is at ``checkpoint.state_uri``, any ledger but
a copy of that campaign's), and (``data prepare``) local sources that match no file.

Left to the flow, which has what it takes: a workdir decided by a storage block, a ledger at
``checkpoint.state_uri`` (credentials, network), sources on S3, and the spec hash of a spec with
block references (it is hashed as resolved).
"""

from __future__ import annotations

from pretrain.spec.campaign import CampaignSpec
from pretrain.spec.layout import ensure_workdir
from pretrain.state.ledger import Ledger, ledger_location
from pretrain.state.remote import refuse_foreign_workdir


def refuse_before_starting(campaign: CampaignSpec, sources: bool = False) -> None:
    """Raise what the flow would refuse at its start: ``UnusableWorkdir`` or ``CorpusError`` (both
    ``ValueError``), ``LedgerError``, ``CampaignMismatch``. Checks the local sources too with
    ``sources``. Writes nothing but the workdir's directory."""
    blocks = campaign.blocks
    if blocks.storage is None:  # else the block decides the workdir: the spec's is not used
        ensure_workdir(campaign.workdir_path)
        layout = campaign.layout
        if campaign.checkpoint.state_uri is not None:  # the workdir keeps a copy of that campaign's ledger, or nothing
            refuse_foreign_workdir(layout.ledger, ledger_location(campaign))
        elif (ledger := Ledger.read(layout)) and not blocks.any():
            ledger.refuse_other_spec(campaign)
    if sources and not any(s.path.startswith("s3://") for group in campaign.data.groups().values() for s in group):
        from pretrain.data.corpus.files import expand_sources

        expand_sources(campaign.data)
