"""MLflow catches up with the campaign; the campaign never waits for MLflow.

What the campaign's MLflow runs show is a view of what the workdir holds: the ledger (runs,
data set, node check, verdicts, evaluations, stage ends) and each job's ``metrics.jsonl`` /
``events.jsonl``. While MLflow's server does not answer, training goes on and the ledger says
``mlflow.behind``; the next sync that finds it answering — at a stage's end, the campaign's end
or its next run — sends everything the runs lack. Every write is idempotent (runs are found by
tags, a metric a run holds at a step is not logged again, tags are overwritten), so a sync can
repeat or stop half-way without harm.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from pretrain.state.schema import CampaignStatus, StageStatus
from pretrain.tracking.dataset_input import log_data_set
from pretrain.tracking.metrics import MetricsForwarder
from pretrain.tracking.runs import Tracker, describe_error, transient
from pretrain.views.compare import ledger_counters
from tasks.checkpoints import verdicts_to_mlflow
from tasks.tracking import log_node_check, mark_mlflow_behind, open_runs_now, tracker_for
from trainer.job.layout import JobLayout


def log_evaluation(
    tracker: Tracker, stage_run_id: str, parent_run_id: str, evaluation: dict, campaign_step: int
) -> None:
    """A stage's final evaluation (``{metric: value, "step": stage step}``, as the ledger holds
    it) at its step on the stage run, at ``campaign_step`` on the campaign's."""
    metrics = {
        k: float(v)
        for k, v in evaluation.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    tracker.log_values(stage_run_id, metrics, evaluation["step"])
    tracker.log_values(parent_run_id, metrics, campaign_step)


def sync_stage_end(spec: CampaignSpec, ledger: Ledger, stage_index: int) -> None:
    """What a stage's end sends when MLflow kept up: its verdicts, its evaluation, its run
    finished. Raises what MLflow fails with (``MlflowAway`` at once if it does not answer)."""
    tracker, record = tracker_for(spec), ledger.reload()
    tracker.check()
    stage = record.stages[spec.stages[stage_index].name]
    if stage.verdicts:
        verdicts_to_mlflow(spec, stage.mlflow_run_id, [v.model_dump(mode="json") for v in stage.verdicts])
    if stage.eval and isinstance(stage.eval.get("step"), int):
        log_evaluation(
            tracker,
            stage.mlflow_run_id,
            record.mlflow.parent_run_id,
            stage.eval,
            spec.step_offset(stage_index) + stage.eval["step"],
        )
    if stage.status == StageStatus.COMPLETED:
        tracker.finish(stage.mlflow_run_id, "FINISHED")


def finish_campaign_run(spec: CampaignSpec, ledger: Ledger) -> None:
    """End the campaign's run FINISHED, with the ledger's restarts and rollbacks as metrics at
    the campaign's last step (``pretrain compare`` reads them)."""
    tracker, record = tracker_for(spec), ledger.reload()
    tracker.check()
    counters = {k: float(v) for k, v in ledger_counters(record).items()}
    tracker.log_values(record.mlflow.parent_run_id, counters, spec.step_offset(len(spec.stages)))
    tracker.finish(record.mlflow.parent_run_id, "FINISHED")


def sync_campaign(spec: CampaignSpec, ledger: Ledger, log: Callable[[str], None]) -> None:
    """Bring the campaign's runs up to the workdir: both kinds of runs opened (or reattached),
    the campaign run's data set input and node check, and for every stage that began: each
    attempt's steps and checkpoint tags, its verdicts and evaluation, its run finished once the
    stage completed. Then the ledger is no longer ``behind``. Raises what MLflow fails with."""
    parent, _ = open_runs_now(spec, ledger)  # checks first that MLflow answers
    tracker, record, layout = tracker_for(spec), ledger.reload(), spec.layout
    if record.data is not None:
        log_data_set(tracker.client, parent, f"{spec.name}-data", record.data.to_json())
    if record.cluster is not None:
        log_node_check(tracker, parent, record.cluster.health, record.cluster.excluded)
    for i, stage in enumerate(spec.stages):
        if record.stages[stage.name].status == StageStatus.PENDING and not record.stages[stage.name].attempts:
            continue
        _, run_id = open_runs_now(spec, ledger, i)
        for attempt in range(record.stages[stage.name].attempts):
            job = JobLayout(layout.job_dir(stage.name, attempt))
            MetricsForwarder(
                tracker, job.metrics, run_id, parent, spec.step_offset(i), events_path=job.events, log=log
            ).send_all()
        sync_stage_end(spec, ledger, i)
    if record.status == CampaignStatus.COMPLETED:
        finish_campaign_run(spec, ledger)
    ledger.set_mlflow_behind(False)


@task(name="sync-to-mlflow", cache_policy=NO_CACHE)
def sync_to_mlflow(spec: CampaignSpec, stage_index: int | None = None) -> bool:
    """Best effort, never a failure of the campaign: with MLflow behind (or its runs not open),
    everything it lacks (:func:`sync_campaign`); else what stage ``stage_index``'s end sends, or
    (None) the campaign run's end once the campaign completed. Returns whether MLflow is up to
    date; if not, one warning and the ledger says ``behind``."""
    logger, ledger = get_run_logger(), Ledger.open(spec)
    record = ledger.reload()
    behind = (
        record.mlflow.behind
        or record.mlflow.parent_run_id is None
        or (stage_index is not None and record.stages[spec.stages[stage_index].name].mlflow_run_id is None)
    )
    try:
        if behind:
            sync_campaign(spec, ledger, logger.warning)
            logger.info("MLflow caught up with the campaign: its runs hold what the workdir holds")
        elif stage_index is not None:
            sync_stage_end(spec, ledger, stage_index)
        elif record.status == CampaignStatus.COMPLETED:
            finish_campaign_run(spec, ledger)
        return True
    except Exception as err:  # noqa: BLE001 - MLflow is a view of the workdir: the campaign goes on
        mark_mlflow_behind(
            ledger,
            "MLflow %s (%s); the campaign goes on, and what its runs lack is sent when it "
            "answers (a stage's end, the campaign's end, its next run)",
            "is away" if transient(err) else "refused an update",
            describe_error(err),
        )
        return False
