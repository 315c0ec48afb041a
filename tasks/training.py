"""Launch one training job, forward its metrics to MLflow while it runs, classify its end."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.cluster.factory import make_cluster
from pretrain.cluster.local import recheck_nodes
from pretrain.redact import redact
from pretrain.run.budget import current_pause
from pretrain.run.incidents import cause_of, incidents
from pretrain.run.jobs import build_job, threads_per_worker, write_job
from pretrain.run.policy import PAUSED, adoptable_attempt
from pretrain.run.stop import CampaignInterrupted, current_stop
from pretrain.settings import PretrainSettings
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.guard import job_lease
from pretrain.state.layout import CampaignLayout
from pretrain.state.ledger import Ledger
from pretrain.state.schema import CampaignRecord
from pretrain.tracking.forwarder import ForwarderThread
from pretrain.tracking.runs import MetricsForwarder, forwarder_backoff
from tasks.tracking import open_runs_now, tracker_for
from tasks.training_progress import StageProgress
from trainer.job.config import JobConfig
from trainer.job.events import EventKind
from trainer.job.reporting import EVENTS, METRICS, JsonLines, read_all


@dataclass
class RejoinWatch:
    """When lost nodes are due for a re-check (``after_s`` after they were lost; 0: never)."""

    after_s: float
    since: dict[int, float] = field(default_factory=dict)

    def lost(self, node: int) -> None:
        self.since[node] = time.monotonic()

    def due(self) -> list[int]:
        now = time.monotonic()
        return sorted(n for n, t in self.since.items() if self.after_s and now - t >= self.after_s)


def try_scale_up(
    spec: CampaignSpec,
    stage: str,
    due: list[int],
    rejoin: RejoinWatch,
    events: JsonLines,
    logger,
    settings: PretrainSettings,
) -> list[int]:
    """Re-check lost nodes; the ones that pass make the job scale back up (returned). The ones
    that fail are checked again after another ``rejoin_after_s``."""
    baseline = Ledger.open(spec).record.node_health()
    fit, rows = recheck_nodes(
        make_cluster(spec.cluster, threads_per_worker(spec), settings=settings, campaign=spec),
        spec.workdir_path,
        due,
        baseline,
        spec.fault_tolerance.node_check_threshold,
    )
    for node in due:
        rejoin.lost(node)  # restart its clock: re-checked later if it did not pass now
    events.write({"event": EventKind.NODE_RECHECK, "nodes": due, "fit": fit, "rows": rows, "source": "orchestrator"})
    if fit:
        logger.info("stage %s: node(s) %s passed the health check again; stopping the job to scale back up", stage, fit)
    else:
        logger.warning(
            "stage %s: lost node(s) %s still fail the health check; training continues without them", stage, due
        )
    return fit


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
    path = CampaignLayout(spec.workdir_path).job_dir(stage, attempt) / "job.json"
    try:
        launched = JobConfig.load(path)
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
            launched.lease.get("generation"),
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
    scaled_up: list[int] = field(
        default_factory=list
    )  # lost nodes that passed a re-check: the job was stopped to take them back
    ended: float | None = None  # when the orchestrator saw the job end (epoch seconds)
    first_step_at: float | None = None  # when its first step was logged (None: it never stepped)
    paused: str | None = None  # why the job was stopped to pause the campaign (its cause is then "paused")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(job_dir: Path, attempt: int, exit_code: int, started: float, log: Path) -> JobResult:
    events = read_all(job_dir / EVENTS)
    metrics = read_all(job_dir / METRICS)
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
    layout = CampaignLayout(spec.workdir_path)
    stop, pause = current_stop(), current_pause()
    if stop is not None and pause is None:  # with a pause request, train-stage does not launch once it is due
        stop.raise_if_requested(f"before stage {spec.stages[stage_index].name} attempt {attempt} started")
    if adopt:
        job_path = layout.job_dir(spec.stages[stage_index].name, attempt) / "job.json"
        job = JobConfig.load(job_path)
    else:
        job = build_job(spec, stage_index, attempt, init_from)
        job_path = write_job(job)
    env = spec.credentials.child_env() if spec.credentials else None  # the blocks' credentials, for this job only
    handle = make_cluster(spec.cluster, job.threads_per_worker, env, settings, campaign=spec).start(
        job, job_path, layout, set(exclude)
    )
    for notice in handle.notices:
        logger.warning("stage %s attempt %d: %s", job.stage, attempt, notice)
    logger.info(
        "stage %s attempt %d: %d node(s) × %d workers, job dir %s",
        job.stage,
        attempt,
        spec.cluster.nodes_in_use(len(exclude)),
        spec.cluster.workers_per_node,
        job.job_dir,
    )
    forwarder = MetricsForwarder(
        tracker_for(spec),
        Path(job.job_dir) / METRICS,
        stage_run_id,
        parent_run_id,
        step_offset,
        events_path=Path(job.job_dir) / EVENTS,
        log=logger.warning,
        backoff=forwarder_backoff(settings),
        open_runs=lambda: open_runs_now(spec, Ledger.open(spec), stage_index),
    )
    forwarding = ForwarderThread(
        forwarder, settings.job_poll_s, settings.mlflow_drain_s
    ).start()  # never in this loop's way
    progress = StageProgress(spec, stage_index, attempt, logger, settings)
    started = time.time()
    rejoin = RejoinWatch(spec.cluster.rejoin_after_s)
    scaled_up: list[int] = []
    interrupted, paused = False, None
    # a second signal kills the job from the main thread, without waiting for this one
    forget_job = stop.kill_at_once(lambda: handle.stop(grace_s=0)) if stop is not None else None
    try:
        code, lost, events = None, {}, JsonLines(Path(job.job_dir) / EVENTS)
        while code is None:
            code = handle.wait(timeout=settings.job_poll_s)
            # not a failure: the operator's stop (under `pretrain run` a signal asks for the pause below instead)
            if stop is not None and stop.requested.is_set() and pause is None and code != 0:
                if code is None:
                    logger.warning(
                        "stage %s: %s received; stopping the job (its savers save at breakpoint, up to %.0fs)",
                        job.stage,
                        stop.name,
                        settings.stop_grace_s,
                    )
                    handle.stop(grace_s=settings.stop_grace_s)
                interrupted, code = True, handle.poll()
            if code is None and pause is not None and (paused := pause.due()):
                logger.info(
                    "stage %s: pausing the campaign: %s; stopping the job (its savers save at breakpoint, up to %.0fs)",
                    job.stage,
                    paused,
                    settings.stop_grace_s,
                )
                handle.stop(grace_s=settings.stop_grace_s)
                code = handle.poll()
            for node, exit_code in handle.lost_nodes().items() if code is None else ():
                if node not in lost:  # a node died while the others go on
                    lost[node] = exit_code
                    replaced = (
                        len(lost) <= handle.spare_nodes
                    )  # a standby node takes its place: nothing to scale up later
                    if not replaced:
                        rejoin.lost(node)
                    logger.warning(
                        "stage %s: node %d lost (exit %s); training continues %s",
                        job.stage,
                        node,
                        exit_code,
                        "with a standby node in its place" if replaced else "on the others",
                    )
                    events.write(node_lost(handle, node, exit_code, standby=replaced))
            for notice in handle.new_notices():
                logger.warning("stage %s attempt %d: %s", job.stage, attempt, notice)
            progress.update()
            if code is None and (due := rejoin.due()):
                scaled_up = try_scale_up(spec, job.stage, due, rejoin, events, logger, settings)
                if scaled_up:
                    handle.stop(
                        grace_s=settings.scale_up_grace_s
                    )  # the savers persist the newest snapshot on the way out
                    code = handle.poll()
        for node in set(handle.silent) - set(lost):  # stopped as the job ended (a job of one node: its failure)
            events.write(node_lost(handle, node, handle.lost_nodes().get(node), standby=False))
        if code and not (interrupted or paused) and stop is not None and stop.requested.is_set():
            interrupted = True  # killed at once by the operator's second signal before a pause began: no job failure
        if not forwarding.finish():
            Ledger.open(spec).set_mlflow_behind(True)  # a later sync sends the rest (tasks.mlflow_sync)
        progress.update(final=True)
    finally:
        forwarding.stop()  # on any error: it drains on its own, nobody waits for it
        handle.stop()  # no-op after a clean exit; on any error (or cancel) no process is left
        if forget_job is not None:
            forget_job()
    for node, tail in handle.failure_logs().items() if code else ():
        logger.error("stage %s: node %d failed; the end of its log:\n%s", job.stage, node, redact(tail))
    result = summarize(Path(job.job_dir), attempt, code, started, Path(handle.logs[0]))
    if interrupted:
        saved = result.last_checkpoint_step
        raise CampaignInterrupted(
            f"campaign interrupted by {stop.name}: stage {job.stage} stopped ("
            + (f"newest checkpoint: step {saved})" if saved else "no checkpoint in this attempt)"),
            stop.signum,
        )
    if scaled_up:
        result.cause, result.scaled_up = "scale_up", scaled_up
    if paused and code != 0:
        result.cause, result.paused, result.time_lost_s = PAUSED, paused, 0.0
    for r in result.resumes:
        if r["source"] == "checkpoint":
            logger.info(
                "stage %s: workers resumed from step %d (%s)", job.stage, r["step"], redact(str(r["checkpoint"]))
            )
    return result


def node_lost(handle, node: int, exit_code: int | None, standby: bool) -> dict:
    """The orchestrator's record of a lost node (``standby``: a standby node takes its place), with
    how long it had been silent when the handle stopped it for that."""
    return {
        "event": EventKind.NODE_LOST,
        "node": node,
        "exit_code": exit_code,
        "standby": standby,
        "source": "orchestrator",
        **({"silent_s": handle.silent[node]} if node in handle.silent else {}),
    }


__all__ = ["JobResult", "adoptable_launch", "run_training_job"]
