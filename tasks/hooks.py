"""State hooks of the campaign flow. A run that fails, crashes or is cancelled records why in the
ledger and ends its MLflow runs truthfully (FAILED / KILLED), wherever the hook runs: failure
hooks run in the flow-run process; crash and cancellation hooks may run in the worker after
the flow-run process was killed, so they find the campaign from the run's parameters alone.

A run that never started the campaign (refused: another run holds it, or another spec owns the
workdir) leaves it alone.
"""

from __future__ import annotations

from prefect.logging.loggers import flow_run_logger

from blocks.references import resolve_campaign
from pretrain.credentials import mlflow_auth
from pretrain.run.outcome import close_campaign
from pretrain.spec.campaign import CampaignSpec, SpecError, parse_spec
from tasks.artifacts import publish_reports


def spec_of_run(parameters: dict) -> CampaignSpec:
    """The campaign a flow run of ``pretrain_campaign`` ran, from its parameters, with its blocks'
    credentials (``spec.credentials``, used inside :func:`mlflow_auth`; never put into this
    process's environment: hooks may run in the worker or ``deployments.serve`` process, which
    goes on to start other campaigns' runs)."""
    inline = parameters.get("spec")
    spec = (
        inline
        if isinstance(inline, CampaignSpec)
        else (parse_spec(inline, "flow run parameter 'spec'") if inline else None)
    )
    return resolve_campaign(spec, parameters.get("spec_path"), parameters.get("workdir"))


def _record(flow_run, state, outcome: str) -> CampaignSpec | None:
    logger = flow_run_logger(flow_run)
    try:
        spec = spec_of_run(flow_run.parameters or {})
    except SpecError as err:
        logger.warning("campaign hook: no campaign to record the %s run in: %s", outcome, err)
        return None
    try:
        cause = (state.message or outcome) if state is not None else outcome
        with mlflow_auth(spec.credentials):
            record = close_campaign(spec, outcome, cause, str(flow_run.id))
        if record is None:
            logger.info("campaign hook: this run never started campaign %s; leaving its ledger alone", spec.name)
            return None
        logger.info("campaign %s marked %s: %s", spec.name, record.end.state, record.end.cause)
        return spec
    except Exception:  # noqa: BLE001 - a hook must never hide the run's own outcome
        logger.exception("campaign hook could not record the %s run", outcome)
        return None


def on_campaign_failure(flow, flow_run, state) -> None:
    spec = _record(flow_run, state, "failed")
    if spec is not None:
        try:
            publish_reports(spec)  # its S3 reads take the spec's credentials
        except Exception:  # noqa: BLE001
            flow_run_logger(flow_run).exception("could not publish the campaign report")


def on_campaign_crashed(flow, flow_run, state) -> None:
    _record(flow_run, state, "crashed")


def on_campaign_cancelled(flow, flow_run, state) -> None:
    _record(flow_run, state, "cancelled")


CAMPAIGN_HOOKS = {
    "on_failure": [on_campaign_failure],
    "on_crashed": [on_campaign_crashed],
    "on_cancellation": [on_campaign_cancelled],
}
