"""MLflow tasks: open (or reattach to) the campaign's runs, close them truthfully."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.compare import ledger_counters, ledger_of
from pretrain.data_input import log_data_set
from pretrain.layout import CampaignLayout
from pretrain.ledger import Ledger
from pretrain.spec import CampaignSpec
from pretrain.tracking import Tracker, transient
from pretrain.tracking_store import artifact_root


def _mlflow_may_recover(task, task_run, state) -> bool:
    """Retry only what MLflow may get over (unreachable, a timeout, 5xx), not a refusal."""
    err = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(err, BaseException) and transient(err)


# For tasks that talk to MLflow: an outage shorter than about two minutes (on top of MLflow's own
# request retries) costs a wait, not the stage. What they write is idempotent (runs are found by
# tags, a metric already held at a step is not logged again).
MLFLOW_RETRIES = {"retries": 4, "retry_delay_seconds": [2, 10, 30, 60], "retry_condition_fn": _mlflow_may_recover}


def tracker_for(spec: CampaignSpec) -> Tracker:
    """The campaign's tracker; a new experiment keeps artifacts beside a shared sqlite store, in
    the workdir otherwise (:func:`pretrain.tracking_store.artifact_root`)."""
    uri = spec.tracking_uri
    return Tracker(uri, spec.tracking.experiment, artifact_root(uri, CampaignLayout(spec.workdir_path).mlflow_artifacts))


def copy_warning(tracker: Tracker, campaign_id: str, workdir: Path) -> str | None:
    """What to tell a user running a copy of a campaign's workdir while the workdir it was copied
    from still holds the campaign: both go on in the same MLflow runs."""
    last = tracker.last_workdir(campaign_id)
    if not last or Path(last).resolve() == Path(workdir).resolve() or ledger_of(last, campaign_id) is None:
        return None  # the first run, the same place, or a campaign moved here
    return (f"{workdir} and {last} hold the same campaign (id {campaign_id}; one is a copy of the other): runs "
            "of either log into the same MLflow runs; for a campaign of its own, start one in an empty workdir")


@task(name="open-campaign-run", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def open_campaign_run(spec: CampaignSpec, ledger: Ledger) -> str:
    params = spec.model_dump(mode="json", exclude={"stages"})
    params["stages"] = ",".join(f"{s.name}:{s.steps}" for s in spec.stages)
    tracker = tracker_for(spec)
    if warning := copy_warning(tracker, ledger.record.campaign_id, spec.workdir_path):
        get_run_logger().warning(warning)
    run_id = tracker.campaign_run(ledger.record.campaign_id, spec.name, spec.spec_hash(), params,
                                  workdir=spec.workdir_path)
    ledger.set_parent_run(run_id)
    return run_id


@task(name="open-stage-run", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def open_stage_run(spec: CampaignSpec, ledger: Ledger, stage_index: int) -> str:
    stage = spec.stages[stage_index]
    run_id = tracker_for(spec).stage_run(ledger.record.campaign_id, ledger.record.mlflow.parent_run_id,
                                         spec.name, stage.name, stage.model_dump(mode="json"))
    ledger.set_stage_run(stage.name, run_id)
    return run_id


@task(name="finish-run", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def finish_run(spec: CampaignSpec, run_id: str, status: str) -> None:
    """End the run; the campaign's own run first gets the ledger's restarts and rollbacks as
    metrics at the campaign's last step (``pretrain compare`` reads them)."""
    tracker = tracker_for(spec)
    ledger = Ledger.read(CampaignLayout(spec.workdir_path))
    if ledger is not None and run_id == ledger.record.mlflow.parent_run_id:
        tracker.log_values(run_id, {k: float(v) for k, v in ledger_counters(ledger.record).items()},
                           spec.step_offset(len(spec.stages)))
    tracker.finish(run_id, status)


@task(name="log-evaluation-to-runs", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def log_stage_evaluation(spec: CampaignSpec, stage_run_id: str | None, parent_run_id: str, metrics: dict,
                         step: int, campaign_step: int) -> None:
    """A stage's evaluation at ``step`` to its run, and at ``campaign_step`` to the campaign's."""
    tracker = tracker_for(spec)
    if stage_run_id:
        tracker.log_values(stage_run_id, metrics, step)
    tracker.log_values(parent_run_id, metrics, campaign_step)


@task(name="log-data-set-input", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def log_data_set_input(spec: CampaignSpec, run_id: str, summary: dict) -> None:
    """The prepared data set as the campaign run's dataset input (idempotent)."""
    log_data_set(tracker_for(spec).client, run_id, f"{spec.name}-data", summary)
