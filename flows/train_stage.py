"""Flow: train one stage to its last step, resuming from the newest *good* checkpoint after any
failure, up to ``resume.max_attempts`` launches.

While a job trains, the flow runs the validation gate on every checkpoint the savers commit
(each in its own process, overlapping training); a job's end is followed by judging what is
left, so the next launch (or the stage's end) only ever relies on validated checkpoints."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.locking import holds_campaign_lock
from pretrain.incidents import NON_RETRYABLE
from pretrain.ledger import Ledger
from pretrain.settings import PretrainSettings
from pretrain.spec import CampaignSpec
from tasks.checkpoints import find_resume_point, judge_pending
from tasks.events import job_restarts, stage_failed, stage_relaunched
from tasks.tracking import open_stage_run
from tasks.training import run_training_job


def _finished(future) -> bool:
    future.wait(timeout=PretrainSettings.from_env().gate_poll_s)  # then the gate judges what was committed meanwhile
    return future.state.is_final()


class StageFailed(RuntimeError):
    """The stage did not reach its last step within its attempts."""


@flow(name="train-stage")
@holds_campaign_lock
def train_stage(spec: CampaignSpec, stage_index: int, init_from: str | None = None) -> dict:
    """Returns the stage's final checkpoint ``{"step", "path"}``."""
    logger = get_run_logger()
    stage = spec.stages[stage_index]
    ledger = Ledger.open(spec)
    stage_run_id = open_stage_run(spec, ledger, stage_index)
    parent_run_id = ledger.data["mlflow"]["parent_run_id"]
    step_offset = sum(s.steps for s in spec.stages[:stage_index])
    ledger.update_stage(stage.name, status="running")
    last = None
    launches_left, scale_ups_left = spec.resume.max_attempts, spec.resume.max_attempts
    while launches_left > 0:
        launches_left -= 1
        point = find_resume_point(spec, stage_index)
        if point and point["step"] >= stage.steps:
            break
        attempt = ledger.stage(stage.name)["attempts"]
        logger.info("stage %s: launching attempt %d from %s", stage.name, attempt,
                    f"checkpoint step {point['step']}" if point else (init_from or "scratch"))
        ledger.update_stage(stage.name, attempts=attempt + 1)
        if attempt:
            stage_relaunched(spec, stage.name, attempt, point["step"] if point else None)
        exclude = (ledger.reload().get("cluster") or {}).get("excluded", [])
        job = run_training_job.submit(spec, stage_index, attempt, init_from, stage_run_id, parent_run_id, step_offset, exclude)
        while not _finished(job):
            judge_pending(spec, stage_index)  # the gate overlaps training
        last = job.result()
        for r in last.resumes:
            ledger.append(stage.name, "resumes", {"attempt": attempt, **r})
        job_restarts(spec, stage.name, attempt, last.resumes)
        for incident in last.incidents:
            logger.warning("stage %s: %s — %s (recovered in %ss, %.1fs lost)", stage.name, incident["cause"],
                           incident["action"], incident["recovery_s"], incident["time_lost_s"])
            ledger.append(stage.name, "failures", incident)
        in_job_restarts = max((r["restart_count"] for r in last.resumes), default=0)
        ledger.update_stage(stage.name, restarts=ledger.stage(stage.name)["restarts"] + in_job_restarts)
        if last.ok:
            continue  # the loop re-checks the pointer: success means the last step is committed
        if last.cause == "scale_up" and scale_ups_left > 0:  # a planned relaunch, not a failure
            scale_ups_left, launches_left = scale_ups_left - 1, launches_left + 1
            logger.info("stage %s: node(s) %s are back; relaunching on all nodes from the newest checkpoint",
                        stage.name, last.scaled_up)
            ledger.append(stage.name, "resizes", {"attempt": attempt, "nodes_back": last.scaled_up,
                                                  "duration_s": round(last.duration_s, 2)})
            continue
        logger.warning("stage %s attempt %d failed (%s: %s) after %.1fs; %.1fs of work lost; log: %s",
                       stage.name, attempt, last.cause, "; ".join(last.errors) or "no worker error reported",
                       last.duration_s, last.time_lost_s, last.log)
        ledger.append(stage.name, "failures", {"attempt": attempt, "in_job": False, "cause": last.cause,
                                               "action": "relaunch the job" if last.cause not in NON_RETRYABLE else "stop",
                                               "exit_code": last.exit_code, "time_lost_s": round(last.time_lost_s, 2),
                                               "errors": last.errors, "log": last.log})
        if last.cause in NON_RETRYABLE:
            break
    point = find_resume_point(spec, stage_index)
    if not point or point["step"] < stage.steps:
        ledger.update_stage(stage.name, status="failed")
        cause = f"{last.cause} ({'; '.join(last.errors)})" if last and last.errors else (last.cause if last else "unknown")
        failed = StageFailed(
            f"stage {stage.name} stopped at step {point['step'] if point else 0}/{stage.steps} after "
            f"{ledger.stage(stage.name)['attempts']} attempt(s); last failure: {cause}. Logs: {spec.workdir_path / 'jobs' / stage.name}. "
            f"Fix the cause and run the same command again: it resumes from the last good checkpoint.")
        stage_failed(spec, stage.name, point["step"] if point else 0, ledger.stage(stage.name)["attempts"],
                     last.cause if last else None, str(failed))
        raise failed
    ledger.update_stage(stage.name, status="trained", final_checkpoint=point)
    return point
