"""Launch one training job, forward its metrics to MLflow while it runs, classify its end."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.cluster.factory import make_cluster
from pretrain.redact import redact
from pretrain.run.budget import current_pause
from pretrain.run.incidents import cause_of, incidents
from pretrain.run.jobs import build_job, threads_per_worker, write_job
from pretrain.run.policy import PAUSED, adoptable_attempt
from pretrain.run.stop import CampaignInterrupted, StopRequest, current_stop
from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import job_lease
from pretrain.state.ledger import Ledger
from pretrain.state.schema import CampaignRecord
from pretrain.tracking.forwarder import ForwarderThread
from pretrain.tracking.metrics import MetricsForwarder, forwarder_backoff
from tasks.job_supervisor import JobSupervisor
from tasks.tracking import open_runs_now, tracker_for
from trainer.job.config import JobConfig
from trainer.job.events import EventKind
from trainer.job.layout import JobLayout
from trainer.job.reporting import read_all


def adoptable_launch(
    spec: CampaignSpec, stage_index: int, record: CampaignRecord, logger, settings: PretrainSettings | None = None
) -> tuple[int, str] | None:
    """``(attempt, live job)`` when the stage's last launch still runs without an orchestrator (its
    flow process died) on a cluster whose jobs outlive it, and may still commit: the re-run takes
    it back instead of launching the next attempt. None: launch the next attempt (which retires
    any job of an earlier launch)."""
    stage = spec.stages[stage_index].name
    cluster = make_cluster(spec.cluster, threads_per_worker(spec), settings=settings, campaign=spec)
    attempt = adoptable_attempt(
        stage, record.stages[stage].attempts, record.spans, record.stages[stage].failures, cluster.adopts_live_jobs
    )
    if attempt is None:
        return None
    try:
        launched = JobConfig.load(JobLayout(spec.layout.job_dir(stage, attempt)).config)
        live = cluster.live_job(stage, attempt)
    except (OSError, ValueError, TypeError, KeyError) as e:  # a damaged job.json, or the API refused: launch anew
        logger.warning("stage %s: cannot take back attempt %d (%s); launching the next attempt", stage, attempt, e)
        return None
    if live and launched.lease != job_lease(spec):  # the lease changed holder: that job can commit nothing
        logger.warning(
            "stage %s: the live job %s of attempt %d runs under the campaign lease generation %s, which "
            "this run took over: it is fenced, so the next attempt replaces it",
            stage,
            live,
            attempt,
            launched.lease.generation if launched.lease else None,
        )
        return None
    return (attempt, live) if live else None


@dataclass
class JobResult:
    attempt: int
    exit_code: int
    cause: str | None  # None on success
    duration_s: float
    time_lost_s: float  # work since the job's last checkpoint, lost if it failed
    last_checkpoint_step: int | None
    resumes: list[dict] = field(default_factory=list)  # in-job (re)starts that loaded state
    incidents: list[dict] = field(default_factory=list)  # failures recovered inside the job
    errors: list[str] = field(default_factory=list)  # what the workers reported before exiting
    log: str = ""  # the node agent's log file
    # lost nodes that passed a re-check: the job was stopped to take them back
    scaled_up: list[int] = field(default_factory=list)
    ended: float | None = None  # when the orchestrator saw the job end (epoch seconds)
    first_step_at: float | None = None  # when its first step was logged (None: it never stepped)
    paused: str | None = None  # why the job was stopped to pause the campaign (its cause is then "paused")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def to_dict(self) -> dict:
        return asdict(self)


def read_result(job_dir: Path, attempt: int, exit_code: int, started: float, log: Path) -> JobResult:
    """The job's result, read from its events and metrics."""
    events = read_all(JobLayout(job_dir).events)
    metrics = read_all(JobLayout(job_dir).metrics)
    last_start = max((e["time"] for e in events if e["event"] == EventKind.START), default=started)
    ckpts = [e for e in events if e["event"] == EventKind.CHECKPOINT]
    resumes = [
        {
            "restart_count": e["restart_count"],
            "step": e["step"],
            "source": e["source"],
            "checkpoint": e["checkpoint"],
            "time": e["time"],
        }
        for e in events
        if e["event"] == EventKind.START and e["rank"] == 0
    ]
    last_safe = max([started] + [e["time"] for e in ckpts])
    ended = time.time()
    cause = None if exit_code == 0 else cause_of([e for e in events if e["time"] >= last_start], exit_code)
    return JobResult(
        attempt=attempt,
        exit_code=exit_code,
        cause=cause,
        incidents=incidents(events, metrics, attempt),
        duration_s=ended - started,
        time_lost_s=0.0 if exit_code == 0 else ended - last_safe,
        last_checkpoint_step=ckpts[-1]["step"] if ckpts else None,
        resumes=resumes,
        errors=sorted({e["error"] for e in events if e["event"] == EventKind.ERROR}),
        log=str(log),
        ended=ended,
        first_step_at=min((m["time"] for m in metrics if "time" in m), default=None),
    )


@task(name="run-training-job", cache_policy=NO_CACHE)
def run_training_job(
    spec: CampaignSpec,
    stage_index: int,
    attempt: int,
    init_from: str | None,
    stage_run_id: str | None,
    parent_run_id: str | None,
    step_offset: int,
    exclude: list[int] = (),
    settings: PretrainSettings | None = None,
    adopt: bool = False,
) -> JobResult:
    """Start the stage's job on the cluster and wait for it, streaming metrics to MLflow. An
    operator's stop (``pretrain.run.stop``) stops the job with a save at breakpoint and raises
    ``CampaignInterrupted``. ``settings``: the waits and polls (None: this process's environment).
    ``adopt``: the launch's job still runs (``adoptable_launch``): its ``job.json``, which its pods
    read (again at every in-job restart), is used as it is, never rewritten."""
    logger = get_run_logger()
    settings = settings or PretrainSettings.from_env()
    stop, pause = current_stop(), current_pause()
    if stop is not None and pause is None:  # with a pause request, train-stage does not launch once it is due
        stop.raise_if_requested(f"before stage {spec.stages[stage_index].name} attempt {attempt} started")
    job, handle = launch(spec, stage_index, attempt, init_from, exclude, settings, adopt, logger)
    forwarding = forward_metrics(spec, stage_index, job, stage_run_id, parent_run_id, step_offset, settings, logger)
    supervisor = JobSupervisor(spec, stage_index, attempt, job, handle, stop, pause, logger, settings)
    with _cleaned_up(handle, forwarding, stop):
        supervisor.until_end()
        if not forwarding.finish():
            Ledger.open(spec).set_mlflow_behind(True)  # a later sync sends the rest (tasks.mlflow_sync)
        supervisor.progress.update(final=True)
    return summarize(supervisor, logger)


def launch(
    spec: CampaignSpec,
    stage_index: int,
    attempt: int,
    init_from: str | None,
    exclude: list[int],
    settings: PretrainSettings,
    adopt: bool,
    logger,
):
    """Write the attempt's ``job.json`` (``adopt``: read the live job's own) and start the job on the
    cluster: ``(job, handle)``."""
    layout = spec.layout
    if adopt:
        job_path = JobLayout(layout.job_dir(spec.stages[stage_index].name, attempt)).config
        job = JobConfig.load(job_path)
    else:
        job = build_job(spec, stage_index, attempt, init_from)
        job_path = write_job(job)
    env = spec.credentials.child_env() if spec.credentials else None  # the blocks' credentials, for this job only
    handle = make_cluster(spec.cluster, job.cluster.threads_per_worker, env, settings, campaign=spec).start(
        job, job_path, layout, set(exclude)
    )
    for notice in handle.notices:
        logger.warning("stage %s attempt %d: %s", job.stage.name, attempt, notice)
    logger.info(
        "stage %s attempt %d: %d node(s) × %d workers, job dir %s",
        job.stage.name,
        attempt,
        spec.cluster.nodes_in_use(len(exclude)),
        spec.cluster.workers_per_node,
        job.job_dir,
    )
    return job, handle


def forward_metrics(
    spec: CampaignSpec,
    stage_index: int,
    job: JobConfig,
    stage_run_id: str | None,
    parent_run_id: str | None,
    step_offset: int,
    settings: PretrainSettings,
    logger,
) -> ForwarderThread:
    """The started thread that forwards the job's metrics and events to MLflow, never in the watch's way."""
    forwarder = MetricsForwarder(
        tracker_for(spec),
        job.layout.metrics,
        stage_run_id,
        parent_run_id,
        step_offset,
        events_path=job.layout.events,
        log=logger.warning,
        backoff=forwarder_backoff(settings),
        open_runs=lambda: open_runs_now(spec, Ledger.open(spec), stage_index),
    )
    return ForwarderThread(forwarder, settings.job_poll_s, settings.mlflow_drain_s).start()


@contextmanager
def _cleaned_up(handle, forwarding: ForwarderThread, stop: StopRequest | None) -> Iterator[None]:
    """While the job is watched, a second signal kills it from the main thread, without waiting for
    the watch; after, no process and no forwarding is left, whatever ended the block."""
    forget_job = stop.kill_at_once(lambda: handle.stop(grace_s=0)) if stop is not None else None
    try:
        yield
    finally:
        forwarding.stop()  # on any error: it drains on its own, nobody waits for it
        handle.stop()  # no-op after a clean exit; on any error (or cancel) no process is left
        if forget_job is not None:
            forget_job()


def summarize(supervisor: JobSupervisor, logger) -> JobResult:
    """The ended job's result, with what its supervisor saw; raises ``CampaignInterrupted`` when the
    operator stopped it."""
    handle, code, stage, stop = supervisor.handle, supervisor.code, supervisor.stage, supervisor.stop
    for node, tail in handle.failure_logs().items() if code else ():
        logger.error("stage %s: node %d failed; the end of its log:\n%s", stage, node, redact(tail))
    result = read_result(supervisor.job_dir, supervisor.attempt, code, supervisor.started, Path(handle.logs[0]))
    if supervisor.interrupted:
        saved = result.last_checkpoint_step
        raise CampaignInterrupted(
            f"campaign interrupted by {stop.name}: stage {stage} stopped ("
            + (f"newest checkpoint: step {saved})" if saved else "no checkpoint in this attempt)"),
            stop.signum,
        )
    if supervisor.scaled_up:
        result.cause, result.scaled_up = "scale_up", supervisor.scaled_up
    if supervisor.paused and code != 0:
        result.cause, result.paused, result.time_lost_s = PAUSED, supervisor.paused, 0.0
    for r in result.resumes:
        if r["source"] == "checkpoint":
            logger.info("stage %s: workers resumed from step %d (%s)", stage, r["step"], redact(str(r["checkpoint"])))
    return result


__all__ = ["JobResult", "adoptable_launch", "run_training_job"]
