"""How ``pretrain data prepare`` runs the ``prepare-data`` flow in its own process: the same flow
a campaign runs (lock, ledger record, progress artifact, MLflow input), against this process's
own Prefect API server when none is configured, with the CLI's progress display attached."""

from __future__ import annotations

import importlib

from deployments.api_server import api_server_for_this_run
from deployments.console import quiet_console
from pretrain.data.prepare.progress import ProgressCallback
from pretrain.spec.campaign import CampaignSpec


def prepare_data_here(spec: CampaignSpec, progress: ProgressCallback | None = None) -> dict:
    """Prepare (or reuse) the campaign's data set in this process; returns the flow's summary.
    Raises what the flow raised (a bad data section, a busy campaign, Ctrl-C)."""
    with api_server_for_this_run(while_starting=lambda: importlib.import_module("flows.prepare_data")), quiet_console():
        from flows.prepare_data import prepare_data

        return prepare_data(spec=spec, progress=progress)
