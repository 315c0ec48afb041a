"""The campaign's guard (its workdir lock, or its lease when its state is on shared storage:
``pretrain.state.guard``) around a flow that writes campaign state (ledger, checkpoints, verdicts): run
on its own it is refused while the campaign runs; called by the campaign flow as a subflow it
shares the campaign's guard (reentrant within a flow run)."""

from __future__ import annotations

import functools

from prefect.runtime import flow_run

from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import campaign_guard


def holds_campaign_lock(fn):
    """Decorate a flow function whose first parameter is the campaign's ``spec``."""

    @functools.wraps(fn)
    def locked(spec: CampaignSpec, *args, **kwargs):
        with campaign_guard(spec, flow_run.get_id()):
            return fn(spec, *args, **kwargs)

    return locked
