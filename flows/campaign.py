"""Flow: a whole pre-training campaign.

prepare_data → provision_cluster → for each stage: train_stage → validate_checkpoint → evaluate.

Time-boxed (``run_for`` / ``until``, ``pretrain.run.budget``): near the budget's end the running job
is stopped with a save at breakpoint, the gate judges it, and the run ends Completed with the
campaign *paused*; the next run continues it.

Cancelled from Prefect (the UI, ``prefect flow-run cancel``), or its flow-run process sent SIGTERM
(a pod eviction, a worker shutting down): the same pause, within the time the worker leaves
before its SIGKILL (``pretrain.run.stop.pause_on_termination``); the ledger says *paused* with
the cause, and a cancelled run still ends Cancelled in Prefect — what the user asked for — while
the next run (scheduled or manual) continues the campaign; an evicted one ends Completed, as a
spent time budget does.

Idempotent: everything it needs to continue is in the workdir (data manifest, checkpoints,
ledger), so running it again after any crash — of a worker, of the job, of this process —
skips what is done and resumes the current stage from its newest good checkpoint. At the end,
the final good checkpoint is exported and registered in the MLflow model registry.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from blocks.references import resolve_campaign
from flows.evaluate import evaluate
from flows.prepare_data import prepare_data
from flows.provision_cluster import provision_cluster
from flows.stopping import StopPoints, next_stage, paused, stoppable, time_boxed
from flows.train_stage import train_stage
from flows.validate_checkpoint import validate_checkpoint
from pretrain.credentials import mlflow_auth
from pretrain.run.stop import StopRequest
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import campaign_guard, state_location
from pretrain.state.ledger import Ledger
from pretrain.state.schema import CampaignStatus, SpanKind, StageStatus
from pretrain.views.status import campaign_status
from tasks.artifacts import link_mlflow_run, publish_goodput, publish_reports
from tasks.events import campaign_completed
from tasks.hooks import CAMPAIGN_HOOKS
from tasks.job_records import restore_job_records
from tasks.mlflow_sync import sync_to_mlflow
from tasks.registry import register_or_defer
from tasks.tracking import open_campaign_run, tracker_for
from trainer.zygote.client import zygote_running


@flow(name="pretrain-campaign", **CAMPAIGN_HOOKS)
def pretrain_campaign(
    spec: CampaignSpec | None = None,
    spec_path: str | None = None,
    workdir: str | None = None,
    run_for: str | None = None,
    until: str | None = None,
) -> dict:
    """Run (or resume) a campaign. Give ``spec`` inline or ``spec_path`` (a YAML file or
    ``builtin:tiny``); ``workdir`` overrides where the campaign keeps its state. ``run_for``
    (``2h``, ``90m``) / ``until`` (``06:00``, an ISO time): the run's time budget; when it is
    near, the campaign pauses at a validated checkpoint and the run ends Completed; so does a
    SIGTERM to this process (a cancel from Prefect: the run then ends Cancelled). One run per
    campaign at a time: a second run of the same campaign fails at once (``CampaignBusy``)."""
    with time_boxed(run_for, until):
        return _campaign(resolve_campaign(spec, spec_path, workdir))


def _campaign(spec: CampaignSpec) -> dict:
    spec.workdir_path.mkdir(parents=True, exist_ok=True)
    # the run's fork server (torch imported once: node checks, node agents, gate passes), started
    # now so that its imports overlap the data preparation; the tasks find it in their context
    with (
        campaign_guard(spec, flow_run.get_id()),
        zygote_running(log=get_run_logger().warning),
        mlflow_auth(spec.credentials),
        subflows_without_heartbeats(),
    ):
        return stoppable(spec, run_campaign)


def subflows_without_heartbeats():
    """The stage flows run in this flow's process: this flow run's heartbeats (its thread started
    with it) already say the process lives. Their own heartbeat threads sleep in 1 s ticks, and
    each flow run's end waited up to a second for its thread: ~5 s of idle time per stage."""
    return temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def run_campaign(spec: CampaignSpec, stop: StopRequest | None = None) -> dict:
    with Ledger.open(spec).timed(SpanKind.RUN):  # the run's wall time, for the goodput split
        return _run_campaign(spec, stop)


def _run_campaign(spec: CampaignSpec, stop: StopRequest | None = None) -> dict:
    stops = StopPoints(stop)
    logger = get_run_logger()
    ledger = Ledger.open(spec)
    spec, parent_run_id = _begin_run(spec, ledger)
    with ledger.timed(SpanKind.DATA_PREPARATION):
        prepare_data(spec)
    stops.check("after preparing the data")
    if why := stops.pause_due():
        return paused(spec, *next_stage(spec, ledger), why)
    with ledger.timed(SpanKind.NODE_CHECK):
        provision_cluster(spec)
    init_from = None
    for i, stage in enumerate(spec.stages):
        done = ledger.reload().stages[stage.name]
        if done.status == StageStatus.COMPLETED:
            logger.info("stage %s already completed at step %s; skipping", stage.name, done.final_checkpoint.step)
            init_from = done.good_checkpoint.path
            continue
        stops.check(f"before stage {stage.name}")
        if why := stops.pause_due():
            return paused(spec, stage.name, max(done.newest_good_step(), 0), why)
        with ledger.timed(SpanKind.STAGE, stage.name):
            final = train_stage(spec, i, stage.init_from or init_from)
            if final.get("paused"):
                return paused(spec, stage.name, final["step"], final["paused"])
            stops.check(f"after training stage {stage.name}, before its validation")
            if why := stops.pause_due():  # trained: the next run validates and evaluates it
                return paused(spec, stage.name, final["step"], why)
            with ledger.timed(SpanKind.VALIDATION_EVAL, stage.name):
                validate_checkpoint(spec, stage.name, final["path"])
                evaluate(spec, stage.name, final["path"], final["step"])
            ledger.set_stage_status(stage.name, StageStatus.COMPLETED)
            # to MLflow: the stage's verdicts, evaluation and end; all it lacks if it was away
            parent_run_id = linked_after_sync(spec, i, parent_run_id)
        publish_reports(spec)
        init_from = final["path"]
    stops.check("before registering the final model")
    return _complete(spec, ledger, parent_run_id)


def _begin_run(spec: CampaignSpec, ledger: Ledger) -> tuple[CampaignSpec, str | None]:
    """Record this run's start: the spec on the campaign's own tracking store, and the campaign's
    MLflow run (None: MLflow away, training does not wait for it)."""
    spec = spec.with_tracking_uri(
        ledger.record.mlflow.tracking_uri
    )  # its own store, from whichever directory it resumes
    ledger.begin_run(flow_run.get_id(), spec)
    if state_location(spec):  # state on shared storage: the jobs' records a workdir lacks are copied in
        restore_job_records(spec)
    get_run_logger().info("campaign %s in %s (spec %s)", spec.name, spec.workdir_path, spec.spec_hash())
    parent_run_id = open_campaign_run(spec, ledger)
    if parent_run_id:
        link_mlflow_run(spec, tracker_for(spec).experiment_id, parent_run_id)
        if ledger.reload().mlflow.behind:  # an earlier run's outage: MLflow catches up now
            sync_to_mlflow(spec)
    return spec, parent_run_id


def _complete(spec: CampaignSpec, ledger: Ledger, parent_run_id: str | None) -> dict:
    """Register the final model and end the campaign completed; its status."""
    if spec.tracking.register_model:  # the registry needs the campaign run
        parent_run_id = linked_after_sync(spec, None, parent_run_id)
    with ledger.timed(SpanKind.REGISTRATION):
        register_or_defer(spec)  # after every stage is completed: MLflow away defers it to the next run
    ledger.set_status(CampaignStatus.COMPLETED)
    parent_run_id = linked_after_sync(spec, None, parent_run_id)  # the campaign run ends
    status = campaign_status(spec.workdir_path, spec.credentials.s3_options(), live=True)
    publish_reports(spec, status, publish_goodput(spec, status, parent_run_id))
    campaign_completed(spec, status)
    return status


def linked_after_sync(spec: CampaignSpec, stage_index: int | None, parent_run_id: str | None) -> str | None:
    """``sync_to_mlflow`` (best effort); the campaign run's id after it (None: none open yet),
    linked from Prefect if it was opened now."""
    sync_to_mlflow(spec, stage_index)
    opened = Ledger.open(spec).record.mlflow.parent_run_id  # where the campaign's state lives (state_uri too)
    if opened and opened != parent_run_id:
        link_mlflow_run(spec, tracker_for(spec).experiment_id, opened)
    return opened
