"""MLflow tasks: open (or reattach to) the campaign's runs, close them truthfully."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from pretrain.tracking.dataset_input import log_data_set
from pretrain.tracking.health import MlflowAway
from pretrain.tracking.runs import Tracker, transient
from pretrain.tracking.store import artifact_root
from pretrain.views.compare import ledger_of


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
    the workdir otherwise (:func:`pretrain.tracking.store.artifact_root`)."""
    uri = spec.tracking_uri
    return Tracker(uri, spec.tracking.experiment, artifact_root(uri, spec.layout.mlflow_artifacts))


def copy_warning(tracker: Tracker, campaign_id: str, workdir: Path) -> str | None:
    """What to tell a user running a copy of a campaign's workdir while the workdir it was copied
    from still holds the campaign: both go on in the same MLflow runs."""
    last = tracker.last_workdir(campaign_id)
    if not last or Path(last).resolve() == Path(workdir).resolve() or ledger_of(last, campaign_id) is None:
        return None  # the first run, the same place, or a campaign moved here
    return (
        f"{workdir} and {last} hold the same campaign (id {campaign_id}; one is a copy of the other): runs "
        "of either log into the same MLflow runs; for a campaign of its own, start one in an empty workdir"
    )


def open_runs_now(
    spec: CampaignSpec, ledger: Ledger, stage_index: int | None = None, log: Callable[[str], None] | None = None
) -> tuple[str, str | None]:
    """Open (or reattach to and set running) the campaign's run — for a stage (``stage_index``)
    only if the ledger has none — and the stage's; both recorded in the ledger: ``(campaign run,
    stage run or None)``. MLflow must answer (:class:`MlflowAway` at once if it does not).
    ``log``: where a copy of the campaign is said."""
    tracker = tracker_for(spec)
    tracker.check()
    campaign_id, parent = ledger.record.campaign_id, ledger.reload().mlflow.parent_run_id
    if stage_index is None or parent is None:
        if log is not None and (warning := copy_warning(tracker, campaign_id, spec.workdir_path)):
            log(warning)
        params = spec.model_dump(mode="json", exclude={"stages"})
        params["stages"] = ",".join(f"{s.name}:{s.steps}" for s in spec.stages)
        parent = tracker.campaign_run(campaign_id, spec.name, spec.spec_hash(), params, workdir=spec.workdir_path)
        ledger.set_parent_run(parent)
    if stage_index is None:
        return parent, None
    stage = spec.stages[stage_index]
    run_id = tracker.stage_run(campaign_id, parent, spec.name, stage.name, stage.model_dump(mode="json"))
    ledger.set_stage_run(stage.name, run_id)
    return parent, run_id


def mark_mlflow_behind(ledger: Ledger, message: str, *args) -> None:
    """The ledger says MLflow is behind; ``message`` is logged as a warning the first time, as info
    while the outage was already told (this run, or one before it): one warning per outage."""
    said = ledger.reload().mlflow.behind
    ledger.set_mlflow_behind(True)
    logger = get_run_logger()
    (logger.info if said else logger.warning)(message, *args)


def _training_goes_on(ledger: Ledger, err: MlflowAway, what: str) -> None:
    mark_mlflow_behind(ledger, "%s; training goes on: %s once it answers", err, what)


@task(name="open-campaign-run", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def open_campaign_run(spec: CampaignSpec, ledger: Ledger) -> str | None:
    """The campaign's run; None while MLflow does not answer (training does not wait: the runs
    are opened, and what they missed logged, once it answers — :mod:`tasks.mlflow_sync`)."""
    try:
        return open_runs_now(spec, ledger, log=get_run_logger().warning)[0]
    except MlflowAway as err:
        _training_goes_on(ledger, err, "the campaign's MLflow runs are opened")
        return None


@task(name="open-stage-run", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def open_stage_run(spec: CampaignSpec, ledger: Ledger, stage_index: int) -> None:
    """The stage's run (and the campaign's, if it has none), recorded in the ledger; while MLflow
    does not answer, nothing: the job's metrics forwarder opens them once it answers."""
    try:
        open_runs_now(spec, ledger, stage_index)
    except MlflowAway as err:
        _training_goes_on(ledger, err, "the stage's steps wait in its metrics.jsonl and reach MLflow")


def log_node_check(tracker: Tracker, run_id: str, rows: list[dict], excluded: list[int]) -> None:
    """The node health check on the campaign run: its rows as an artifact, the excluded nodes as a tag."""
    tracker.client.log_dict(run_id, rows, "node_check.json")
    tracker.set_tags(run_id, {"cluster.excluded_nodes": ",".join(map(str, excluded)) or "none"})


@task(name="log-data-set-input", cache_policy=NO_CACHE, **MLFLOW_RETRIES)
def log_data_set_input(spec: CampaignSpec, run_id: str, summary: dict) -> None:
    """The prepared data set as the campaign run's dataset input (idempotent)."""
    log_data_set(tracker_for(spec).client, run_id, f"{spec.name}-data", summary)
