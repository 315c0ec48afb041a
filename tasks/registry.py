"""Registry task: the campaign's final good checkpoint becomes a registered MLflow model."""

from __future__ import annotations

import importlib.util

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.checkpoint_info import describe, spec_overrides
from pretrain.ledger import Ledger
from pretrain.redact import redact
from pretrain.registry import register_checkpoint
from pretrain.spec import CampaignSpec
from tasks.tracking import MLFLOW_RETRIES, open_runs_now, tracker_for


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
        logger.warning("transformers is not installed, so the final model is not registered in MLflow: "
                       "reinstall prefect-pretrain (it depends on transformers) and run the campaign again "
                       "(finished stages are skipped)")
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
        info, tracking_uri=spec.tracking_uri, run_id=ledger.record.mlflow.parent_run_id,
        name=spec.registered_model_name, alias=spec.tracking.model_alias, metrics=metrics,
        step=offset + info.step, tags={"pretrain.campaign": spec.name, "pretrain.stage": spec.stages[-1].name})
    ledger.set_registered_model(reg.to_dict())
    logger.info("registered %s version %s (%s) from %s", reg.name, reg.version, reg.uri, redact(good.path))
    return reg.to_dict()
