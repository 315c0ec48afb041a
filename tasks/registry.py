"""Registry task: the campaign's final good checkpoint becomes a registered MLflow model."""

from __future__ import annotations

import importlib.util

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.checkpoints.info import describe, spec_overrides
from pretrain.checkpoints.registry import register_checkpoint
from pretrain.redact import redact
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from pretrain.tracking.runs import describe_error, transient
from tasks.tracking import MLFLOW_RETRIES, open_runs_now, tracker_for

RETRY_DELAYS_S = MLFLOW_RETRIES["retry_delay_seconds"]


def retry_delays(wait_s: float) -> list[float]:
    """The registration's retry delays that fit in ``tracking.registration_wait_s``."""
    out: list[float] = []
    for delay in RETRY_DELAYS_S:
        if sum(out) + delay > wait_s:
            break
        out.append(delay)
    return out


def register_or_defer(spec: CampaignSpec) -> dict | None:
    """``register_final_model``, retried for ``tracking.registration_wait_s`` while MLflow does not
    answer; past that the campaign completes anyway: the ledger says the registration is pending
    and the campaign's next run registers the model (its stages are done: nothing is trained
    again). Any other failure (a refusal, a damaged checkpoint) is the campaign's."""
    delays = retry_delays(spec.tracking.registration_wait_s)
    try:
        return register_final_model.with_options(retries=len(delays), retry_delay_seconds=delays or 0)(spec)
    except Exception as err:  # noqa: BLE001 - only MLflow's absence is deferred; the rest is raised again
        if not transient(err):
            raise
        why = f"MLflow did not answer within {spec.tracking.registration_wait_s:g} s ({describe_error(err)})"
        Ledger.open(spec).set_registration_pending(why)
        get_run_logger().warning(
            "the final model is not registered yet: %s. The campaign is complete; run it again once MLflow answers "
            "and it registers the model (nothing is trained again)",
            why,
        )
        return None


@task(name="register-final-model", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def register_final_model(spec: CampaignSpec) -> dict | None:
    """Export the last stage's good checkpoint, log it to the campaign's MLflow run with its
    eval metrics, register it as ``spec.registered_model_name`` and move the alias to it.
    Returns the registration (also recorded in the ledger), or None when switched off."""
    logger = get_run_logger()
    if not spec.tracking.register_model:
        logger.info("tracking.register_model is off: the final model is not registered")
        return None
    if importlib.util.find_spec("transformers") is None:
        logger.warning(
            "transformers is not installed, so the final model is not registered in MLflow: "
            "reinstall prefect-pretrain (it depends on transformers) and run the campaign again "
            "(finished stages are skipped)"
        )
        return None
    ledger = Ledger.open(spec)
    tracker_for(spec).check()  # while MLflow is away, this task's retries wait (not MLflow's minutes per request)
    if ledger.record.mlflow.parent_run_id is None:  # away since the campaign began: the model belongs to its run
        open_runs_now(spec, ledger)
    last = ledger.stage(spec.stages[-1].name)
    good, evaluation = last.good_checkpoint, last.eval or {}
    info = describe(good.path, **spec_overrides(spec))  # the spec also covers checkpoints without a record
    offset = spec.step_offset(len(spec.stages) - 1)  # campaign step, as in the run's metric history
    metrics = {k: v for k, v in evaluation.items() if k.startswith("val_")}
    reg = register_checkpoint(
        info,
        tracking_uri=spec.tracking_uri,
        run_id=ledger.record.mlflow.parent_run_id,
        name=spec.registered_model_name,
        alias=spec.tracking.model_alias,
        metrics=metrics,
        step=offset + info.step,
        tags={"pretrain.campaign": spec.name, "pretrain.stage": spec.stages[-1].name},
    )
    ledger.set_registered_model(reg.to_dict())
    logger.info("registered %s version %s (%s) from %s", reg.name, reg.version, reg.uri, redact(good.path))
    return reg.to_dict()
