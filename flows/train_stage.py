"""Flow: train one stage to its last step, resuming from the newest *good* checkpoint after any
failure, up to ``resume.max_attempts`` launches.

While a job trains, the flow runs the validation gate on every checkpoint the savers commit
(each in its own process, overlapping training); a job's end is followed by judging what is
left, so the next launch (or the stage's end) only ever relies on validated checkpoints. What
follows a job is decided by the stage policy (``pretrain.run.policy``); this flow runs the tasks and
records what happened."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.locking import holds_campaign_lock
from pretrain.run.budget import PauseRequest, current_pause, margin_s, measured_times
from pretrain.run.incidents import where_hung
from pretrain.run.policy import Action, Budget, Decision, after_job, before_launch, stage_end
from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import state_location
from pretrain.state.ledger import Ledger
from pretrain.state.schema import CheckpointRecord, Failure, Resume, SpanKind, StageStatus
from tasks.checkpoints import find_resume_point, judge_pending
from tasks.events import job_restarts, stage_failed, stage_relaunched
from tasks.job_records import keep_job_records
from tasks.prefect_api import wait_for_api
from tasks.tracking import open_stage_run
from tasks.training import JobResult, adoptable_launch, run_training_job


def _finished(future, poll_s: float) -> bool:
    """The job's task ended: its thread's own future says so, without asking the Prefect API
    (which may be away meanwhile: the task, the gate's tasks and training go on without it)."""
    future.wait(timeout=poll_s)  # then the gate judges what was committed meanwhile
    own = getattr(future, "wrapped_future", None)  # (a task runner whose futures have none: ask the API)
    return own.done() if own is not None else future.state.is_final()


class StageFailed(RuntimeError):
    """The stage did not reach its last step within its attempts."""


def _step(point: dict | None) -> int | None:
    return point["step"] if point else None


@flow(name="train-stage")
@holds_campaign_lock
def train_stage(spec: CampaignSpec, stage_index: int, init_from: str | None = None) -> dict:
    """Returns the stage's final checkpoint ``{"step", "path"}``; or, when the run's time budget
    is spent (``pretrain.run.budget``), its newest good checkpoint with ``paused`` (why), the stage
    recorded *paused* (None: nothing good yet). Its end waits for a Prefect API that is away
    (``PRETRAIN_PREFECT_OUTAGE_S``): the job trained on without it, and the end is a request to it."""
    try:
        result = _train_stage(spec, stage_index, init_from)
    except Exception:
        _wait_for_api(spec, stage_index)
        raise
    _wait_for_api(spec, stage_index)
    return result


def _wait_for_api(spec: CampaignSpec, stage_index: int) -> None:
    wait_for_api(
        get_run_logger(),
        PretrainSettings.from_env().prefect_outage_s,
        f"the end of stage {spec.stages[stage_index].name} (its job has ended)",
    )


def _train_stage(spec: CampaignSpec, stage_index: int, init_from: str | None) -> dict:
    """Launch the stage's job until the stage policy says to stop; then end the stage trained, failed
    or paused."""
    stage = spec.stages[stage_index]
    ledger = Ledger.open(spec)
    open_stage_run(spec, ledger, stage_index)  # while MLflow is away, the job's metrics forwarder opens them
    ledger.set_stage_status(stage.name, StageStatus.RUNNING)
    last, point, paused = _launch_until_done(spec, stage_index, init_from, ledger)
    if paused:
        # the stage is marked paused with the campaign's end, in one ledger write (record_pause): a stop at
        # once between two writes would leave a paused stage in an interrupted campaign
        get_run_logger().info("stage %s: paused at step %s (%s)", stage.name, _step(point) or 0, paused)
        return {"step": _step(point) or 0, "path": point["path"] if point else None, "paused": paused}
    return _end_stage(spec, stage_index, point, last, ledger)


def _launch_until_done(
    spec: CampaignSpec, stage_index: int, init_from: str | None, ledger: Ledger
) -> tuple[JobResult | None, dict | None, str | None]:
    """Launch the stage's job again and again until the stage policy says to stop: the last job's
    result, the resume point then, and why the campaign pauses (None: it does not)."""
    logger, stage = get_run_logger(), spec.stages[stage_index]
    last, budget, pause = None, Budget.of(spec.resume.max_attempts), current_pause()
    while True:
        point = find_resume_point(spec, stage_index)
        decision = before_launch(stage.steps, _step(point), budget)
        if decision.action is Action.LAUNCH and (paused := _pause_due(spec, stage.name, ledger, pause)):
            return last, point, paused
        if decision.action is not Action.LAUNCH:
            if decision.action is Action.GIVE_UP:
                logger.warning("stage %s: not launched again: %s", stage.name, decision.reason)
            return last, point, None
        attempt, adopted = _next_attempt(spec, stage_index, init_from, ledger, point)
        last = run_job(spec, stage_index, attempt, init_from, ledger, adopted)
        decision = after_job(last, attempt, decision.budget)
        budget = decision.budget
        if decision.action is Action.PAUSE:
            return last, find_resume_point(spec, stage_index), last.paused  # the gate judged the final save
        _record_job_end(stage.name, attempt, last, decision, ledger)
        if decision.action is Action.GIVE_UP:
            return last, find_resume_point(spec, stage_index), None


def _pause_due(spec: CampaignSpec, stage: str, ledger: Ledger, pause: PauseRequest | None) -> str | None:
    """Why the campaign pauses instead of this launch (None: launch), once the pause's margin is
    measured on the stage's jobs so far."""
    if pause is None:
        return None
    pause.margin_s = margin_s(
        *measured_times(spec.workdir_path / "jobs" / stage, ledger.reload().stages[stage].verdicts),
        pause.budget_s,
    )
    return pause.due()


def _next_attempt(
    spec: CampaignSpec, stage_index: int, init_from: str | None, ledger: Ledger, point: dict | None
) -> tuple[int, bool]:
    """The attempt to run now, and whether it is the live job of the last one, adopted."""
    logger, stage = get_run_logger(), spec.stages[stage_index]
    adopted = adoptable_launch(spec, stage_index, ledger.reload(), logger)
    if adopted is not None:  # its flow process died while it trained: take it back, no new attempt
        logger.warning(
            "stage %s: adopted the live Job %s of attempt %d (the flow process that launched it is "
            "gone; it trained on meanwhile)",
            stage.name,
            adopted[1],
            adopted[0],
        )
        return adopted[0], True
    attempt = ledger.start_attempt(stage.name)
    logger.info(
        "stage %s: launching attempt %d from %s",
        stage.name,
        attempt,
        f"checkpoint step {point['step']}" if point else (init_from or "scratch"),
    )
    if attempt:
        stage_relaunched(spec, stage.name, attempt, _step(point))
    return attempt, False


def _record_job_end(stage: str, attempt: int, last: JobResult, decision: Decision, ledger: Ledger) -> None:
    """Record a job's end that calls for another launch: a planned resize, or a failure."""
    logger = get_run_logger()
    if decision.resize is not None:  # a planned relaunch, not a failure
        logger.info("stage %s: %s; relaunching on all nodes from the newest checkpoint", stage, decision.reason)
        ledger.record_resize(stage, decision.resize)
    if decision.failure is not None:
        logger.warning(
            "stage %s attempt %d failed (%s: %s) after %.1fs; %.1fs of work lost; log: %s; next: %s",
            stage,
            attempt,
            last.cause,
            "; ".join(last.errors) or "no worker error reported",
            last.duration_s,
            last.time_lost_s,
            last.log,
            decision.reason,
        )
        ledger.record_failure(stage, decision.failure)


def _end_stage(
    spec: CampaignSpec, stage_index: int, point: dict | None, last: JobResult | None, ledger: Ledger
) -> dict:
    """Mark the stage trained at ``point`` (returned), or failed (``StageFailed``)."""
    stage = spec.stages[stage_index]
    end = stage_end(
        stage.name,
        stage.steps,
        _step(point),
        ledger.reload().stages[stage.name].attempts,
        last,
        spec.workdir_path / "jobs" / stage.name,
    )
    if not end.trained:
        ledger.set_stage_status(stage.name, StageStatus.FAILED)
        stage_failed(spec, stage.name, end.step, ledger.stage(stage.name).attempts, end.cause, end.message)
        raise StageFailed(end.message)
    ledger.set_stage_status(stage.name, StageStatus.TRAINED, final_checkpoint=CheckpointRecord(**point))
    return point


def run_job(
    spec: CampaignSpec, stage_index: int, attempt: int, init_from: str | None, ledger: Ledger, adopt: bool = False
) -> JobResult:
    """Run one launch of the stage's job (the gate judging alongside) and record its in-job
    resumes, restarts and recovered failures. ``adopt``: take back the launch's live job (its
    span, opened by the flow process that died, goes on)."""
    logger, stage = get_run_logger(), spec.stages[stage_index].name
    settings = PretrainSettings.from_env()  # once per launch, for the job, its polling and the gate
    record = ledger.reload()  # the MLflow runs: None while none could be opened (MLflow away)
    exclude, stage_run_id, parent_run_id = (
        record.excluded_nodes(),
        record.stages[stage].mlflow_run_id,
        record.mlflow.parent_run_id,
    )
    with ledger.timed(SpanKind.JOB, stage, attempt, resume=adopt):
        job = run_training_job.submit(
            spec,
            stage_index,
            attempt,
            init_from,
            stage_run_id,
            parent_run_id,
            spec.step_offset(stage_index),
            exclude,
            settings,
            adopt,
        )
        while not _finished(job, settings.gate_poll_s):
            judge_pending(spec, stage_index, settings)  # the gate overlaps training
        result = job.result()
    if state_location(spec):  # state on shared storage: the jobs' records beside it (best effort)
        keep_job_records(spec)
    if attempt:  # a relaunch after a failed job: its recovery lasted until this job stepped
        ledger.record_relaunch_recovery(stage, attempt - 1, result.first_step_at)
    for r in result.resumes:
        ledger.record_resume(stage, Resume(attempt=attempt, **r))
    restarts = job_restarts(spec, stage, attempt, result.resumes, result.incidents)
    for incident in result.incidents:
        took = "" if incident["recovery_s"] is None else f"recovered in {incident['recovery_s']}s, "
        where = f"; {where_hung(incident)}" if incident.get("stacks") else ""
        logger.warning(
            "stage %s: %s — %s (%s%.1fs lost)%s",
            stage,
            incident["cause"],
            incident["action"],
            took,
            incident["time_lost_s"],
            where,
        )
        ledger.record_failure(stage, Failure(**incident))
    ledger.add_restarts(stage, restarts)
    return result
