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

import contextvars
import os
import signal
import time

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.logging.handlers import APILogWorker
from prefect.runtime import flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from blocks.references import resolve_campaign
from flows.evaluate import evaluate
from flows.prepare_data import prepare_data
from flows.provision_cluster import provision_cluster
from flows.train_stage import train_stage
from flows.validate_checkpoint import validate_checkpoint
from pretrain.credentials import mlflow_auth
from pretrain.run.budget import PauseRequest, current_pause, deadline, pausing
from pretrain.run.outcome import record_interrupt, record_pause
from pretrain.run.stop import (
    CampaignInterrupted,
    StoppedAtOnce,
    StopRequest,
    current_stop,
    pause_on_termination,
    pause_window_s,
    supervise,
)
from pretrain.settings import PretrainSettings
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
    pause = current_pause() or PauseRequest()  # set by `pretrain run` (or a test); else this run's own
    if end := deadline(run_for, until):  # a bad budget fails here, before anything
        pause.deadline, pause.started = end, time.time()
    with pausing(pause):
        return _campaign(resolve_campaign(spec, spec_path, workdir))


CANCELLED_FROM_PREFECT = "cancelled from Prefect"
ORIGIN_TIMEOUT_S = 5.0  # the API's answer to "is this run being cancelled?", asked once at the signal


def _campaign(spec: CampaignSpec) -> dict:
    spec.workdir_path.mkdir(parents=True, exist_ok=True)
    stop = current_stop()  # set under `pretrain run`: Ctrl-C / SIGTERM stop the campaign
    # the run's fork server (torch imported once: node checks, node agents, gate passes), started
    # now so that its imports overlap the data preparation; the tasks find it in their context
    with (
        campaign_guard(spec, flow_run.get_id()),
        zygote_running(log=get_run_logger().warning),
        mlflow_auth(spec.credentials),
        subflows_without_heartbeats(),
    ):
        if stop is not None:
            return _run_stoppable(spec, stop)
        # this flow runs in its process's main thread (a deployment's run, a pod): SIGTERM pauses
        window_s = pause_window_s(spec.resume.grace_period_s, PretrainSettings.from_env().kill_grace_s)
        pause = current_pause()
        with pause_on_termination(lambda name: pause.ask(f"{name} received")) as stop:
            if stop is None:
                return run_campaign(spec)
            # a cancelled run returns its status too: Prefect refuses the Completed of a run being
            # cancelled, and its worker or runner ends it Cancelled once this process exits
            try:
                return supervise(
                    lambda: _run_stoppable(spec, stop),
                    stop,
                    window_s,
                    get_run_logger().warning,
                    "resume.grace_period_s or PRETRAIN_KILL_GRACE_S less 5s",
                    "a second SIGTERM",
                    on_request=lambda: _note_origin(stop),
                )
            except StoppedAtOnce:
                if stop.origin == CANCELLED_FROM_PREFECT:
                    _leave_to_the_worker()
                raise  # any other SIGTERM goes on to Prefect's handler: the run ends Crashed, as before


def subflows_without_heartbeats():
    """The stage flows run in this flow's process: this flow run's heartbeats (its thread started
    with it) already say the process lives. Their own heartbeat threads sleep in 1 s ticks, and
    each flow run's end waited up to a second for its thread: ~5 s of idle time per stage."""
    return temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def _run_stoppable(spec: CampaignSpec, stop: StopRequest) -> dict:
    stop.flow_run = flow_run.get_id()
    here = contextvars.copy_context()
    stop.recorder = lambda cause, warn: here.run(record_interrupt, spec, stop, stop.describe(cause), warn)
    try:
        return run_campaign(spec, stop)
    except Exception as e:
        if not stop.requested.is_set():
            raise
        raise record_interrupted(spec, stop, e) from None


def being_cancelled() -> bool:
    """Whether this flow run is being cancelled: Prefect's worker or runner marks it Cancelling,
    then sends its SIGTERM. False for any other SIGTERM (a pod eviction, a worker shutting down,
    ``kill``), and when the API does not answer within seconds (the signal's name says enough)."""
    try:
        with get_client(sync_client=True, httpx_settings={"timeout": ORIGIN_TIMEOUT_S}) as client:
            state = client.read_flow_run(flow_run.get_id()).state
    except Exception:  # noqa: BLE001 - a cause less precise, never a failure
        return False
    return state is not None and (state.is_cancelling() or state.is_cancelled())


def _leave_to_the_worker() -> None:
    """End this process as SIGTERM's default action does, once the stop at once is recorded:
    the worker that is cancelling the run then ends it Cancelled (handed to Prefect's handler, a
    SIGTERM whose cancel the worker could not deliver ends the run Crashed first)."""
    APILogWorker.drain_all(timeout=2)  # the run's last lines (the stop at once) reach its logs
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _note_origin(stop: StopRequest) -> None:
    if being_cancelled():
        stop.origin = CANCELLED_FROM_PREFECT


def record_interrupted(spec: CampaignSpec, stop: StopRequest, error: Exception) -> CampaignInterrupted:
    """Record the campaign as interrupted (ledger, MLflow); whatever broke on the way out (a
    validation process the terminal's Ctrl-C also reached), the cause is the operator's stop."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    interrupted = (
        error
        if isinstance(error, CampaignInterrupted)
        else CampaignInterrupted(f"campaign interrupted by {stop.name} ({first_line})", stop.signum)
    )
    logger = get_run_logger()
    record_interrupt(spec, stop, str(interrupted), logger.warning)
    logger.warning("%s; run the same command again to resume", interrupted)
    return interrupted


def run_campaign(spec: CampaignSpec, stop: StopRequest | None = None) -> dict:
    with Ledger.open(spec).timed(SpanKind.RUN):  # the run's wall time, for the goodput split
        return _run_campaign(spec, stop)


def _run_campaign(spec: CampaignSpec, stop: StopRequest | None = None) -> dict:
    pause = current_pause()

    def stop_point(where: str) -> None:
        if stop is not None and pause is None:  # with a pause request, a signal pauses (below)
            stop.raise_if_requested(where)

    def pause_due() -> str | None:  # a spent budget, or a signal to `pretrain run`
        return pause.due() if pause is not None else None

    logger = get_run_logger()
    ledger = Ledger.open(spec)
    spec = spec.with_tracking_uri(
        ledger.record.mlflow.tracking_uri
    )  # its own store, from whichever directory it resumes
    ledger.begin_run(flow_run.get_id(), spec)
    if state_location(spec):  # state on shared storage: the jobs' records a workdir lacks are copied in
        restore_job_records(spec)
    logger.info("campaign %s in %s (spec %s)", spec.name, spec.workdir_path, spec.spec_hash())
    parent_run_id = open_campaign_run(spec, ledger)  # None: MLflow away, training does not wait for it
    if parent_run_id:
        link_mlflow_run(spec, tracker_for(spec).experiment_id, parent_run_id)
        if ledger.reload().mlflow.behind:  # an earlier run's outage: MLflow catches up now
            sync_to_mlflow(spec)
    with ledger.timed(SpanKind.DATA_PREPARATION):
        prepare_data(spec)
    stop_point("after preparing the data")
    if why := pause_due():
        return paused(spec, *_next_stage(spec, ledger), why)
    with ledger.timed(SpanKind.NODE_CHECK):
        provision_cluster(spec)
    init_from = None
    for i, stage in enumerate(spec.stages):
        done = ledger.reload().stages[stage.name]
        if done.status == StageStatus.COMPLETED:
            logger.info("stage %s already completed at step %s; skipping", stage.name, done.final_checkpoint.step)
            init_from = done.good_checkpoint.path
            continue
        stop_point(f"before stage {stage.name}")
        if why := pause_due():
            return paused(spec, stage.name, max(done.newest_good_step(), 0), why)
        with ledger.timed(SpanKind.STAGE, stage.name):
            final = train_stage(spec, i, stage.init_from or init_from)
            if final.get("paused"):
                return paused(spec, stage.name, final["step"], final["paused"])
            stop_point(f"after training stage {stage.name}, before its validation")
            if why := pause_due():  # trained: the next run validates and evaluates it
                return paused(spec, stage.name, final["step"], why)
            with ledger.timed(SpanKind.VALIDATION_EVAL, stage.name):
                validate_checkpoint(spec, stage.name, final["path"])
                evaluate(spec, stage.name, final["path"], final["step"])
            ledger.set_stage_status(stage.name, StageStatus.COMPLETED)
            # to MLflow: the stage's verdicts, evaluation and end; all it lacks if it was away
            parent_run_id = linked_after_sync(spec, i, parent_run_id)
        publish_reports(spec)
        init_from = final["path"]
    stop_point("before registering the final model")
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


def _next_stage(spec: CampaignSpec, ledger: Ledger) -> tuple[str, int]:
    """The first stage not completed, and its newest good step (0: none)."""
    stages = ledger.reload().stages
    name = next((s.name for s in spec.stages if stages[s.name].status != StageStatus.COMPLETED), spec.stages[-1].name)
    return name, max(stages[name].newest_good_step(), 0)


def paused(spec: CampaignSpec, stage: str, step: int, reason: str) -> dict:
    """End this run with the campaign paused (ledger, MLflow runs scheduled); its status."""
    stop = current_stop()
    if stop is not None and stop.signum is not None and reason == f"{stop.name} received":
        reason = stop.describe(reason)  # a signal's pause: "cancelled from Prefect (SIGTERM from its worker)"
    record = record_pause(spec, flow_run.get_id(), stage, step, reason)
    get_run_logger().info("campaign %s %s; run it again to continue", spec.name, record.end.cause)
    status = campaign_status(spec.workdir_path, spec.credentials.s3_options())
    publish_reports(spec, status)
    return status
