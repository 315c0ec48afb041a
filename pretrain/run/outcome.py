"""Record how a campaign run ended — failed, crashed, cancelled, interrupted or paused — in its ledger and
MLflow runs, with the cause. Called by the campaign flow's state hooks, possibly in another
process than the one that ran the campaign (Prefect runs cancellation hooks in the worker after
the flow-run process is gone), so it needs nothing but the spec (the run's parameters); and by ``pretrain run``
when Ctrl-C / SIGTERM stopped it. An interruption stands once recorded: the interrupted flow
still ends failed (or crashed) in Prefect, and that hook must not re-label it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pretrain.run.stop import StopRequest
from pretrain.spec.campaign import CampaignSpec
from pretrain.spec.layout import CampaignLayout
from pretrain.state.ledger import Ledger
from pretrain.state.schema import OPEN_STAGES, CampaignRecord, CampaignStatus, RunEnd, StageStatus
from pretrain.tracking.runs import Tracker, describe_error, transient

# how each way of ending shows in MLflow: a cancel (Prefect) or an interrupt (Ctrl-C / SIGTERM to
# `pretrain run`) is a deliberate kill; a crash of the infrastructure (lost process, OOM kill)
# is a failure of the run like any other
MLFLOW_STATUS = {
    CampaignStatus.FAILED: "FAILED",
    CampaignStatus.CRASHED: "FAILED",
    CampaignStatus.CANCELLED: "KILLED",
    CampaignStatus.INTERRUPTED: "KILLED",
}
# a paused campaign's runs are *scheduled*: MLflow's status for a run that goes on later (the next
# run of the campaign sets them RUNNING again and logs on at the next step)
MLFLOW_PAUSED = "SCHEDULED"
TAG_END_STATE = "pretrain.end_state"
TAG_END_CAUSE = "pretrain.end_cause"
# stages a run was working on when it ended; a failed one was set by train-stage before it
# raised, and its MLflow run is still open
ENDED_STAGES = (*OPEN_STAGES, StageStatus.FAILED)


def close_campaign(spec: CampaignSpec, outcome: str, cause: str, flow_run: str) -> CampaignRecord | None:
    """Mark the campaign and the stages it was working on ``outcome`` with ``cause``, and end its
    MLflow runs with the matching status — if ``flow_run`` is the run the ledger says is running it
    (a run refused before it started, e.g. because another run holds the campaign, changes
    nothing), unless it is recorded as interrupted already. Returns the ledger, whose ``end``
    says how the run ended (None: not a run of this campaign)."""
    if outcome not in MLFLOW_STATUS:
        raise ValueError(f"outcome must be one of {sorted(MLFLOW_STATUS)}, got {outcome!r}")
    ledger = Ledger.of_spec(spec)
    if ledger is None:
        return None
    if _stands(ledger.record, flow_run):
        return ledger.record  # the flow's failure hook after an interruption (or a pause): nothing to write
    outcome = CampaignStatus(outcome)
    open_stages: list[str] = []
    ours = []

    def change(r: CampaignRecord) -> None:
        if r.flow_run != flow_run or _stands(r, flow_run):
            return
        ours.append(True)
        open_stages.extend(n for n, s in r.stages.items() if s.status in ENDED_STAGES)
        for name in open_stages:
            if r.stages[name].status in OPEN_STAGES:
                r.stages[name].status = StageStatus(outcome.value)
        r.status = outcome
        r.end = RunEnd(state=outcome.value, cause=cause, time=time.time(), flow_run=flow_run)

    record = ledger.mutate(change)
    if not ours:
        return record if _stands(record, flow_run) else None
    _end_runs(ledger, open_stages, outcome, cause, MLFLOW_STATUS[outcome])
    return record


def _stands(record: CampaignRecord, flow_run: str) -> bool:
    """``flow_run`` ended the campaign on purpose — interrupted, or paused at a validated
    checkpoint (a second signal arriving after the pause was recorded must not undo it)."""
    return record.interrupted(flow_run) or (
        record.flow_run == flow_run
        and record.end is not None
        and record.end.flow_run == flow_run
        and record.end.state == CampaignStatus.PAUSED
    )


def _end_runs(ledger: Ledger, stages: list[str], state: str, cause: str, mlflow_status: str) -> None:
    """End the MLflow runs of ``stages`` and the campaign's with ``mlflow_status``, tagged with
    how and why. MLflow away (one quick request says so; or a request fails on its side): the
    ledger says ``mlflow.behind`` — a pause or a stop never waits on MLflow (the next run sets the
    runs running again)."""
    record = ledger.record
    run_ids = [record.stages[n].mlflow_run_id for n in stages] + [record.mlflow.parent_run_id]
    run_ids = [r for r in run_ids if r]
    if run_ids:
        tracker = Tracker(record.mlflow.tracking_uri, record.mlflow.experiment, ledger.layout.mlflow_artifacts)
        try:
            tracker.check()
            for run_id in run_ids:
                tracker.set_tags(run_id, {TAG_END_STATE: state, TAG_END_CAUSE: cause[:5000]})
                tracker.finish(run_id, mlflow_status)
        except Exception as err:  # noqa: BLE001 - the ledger holds how the run ended
            if not transient(err):
                raise
            ledger.set_mlflow_behind(True)
            logging.getLogger(__name__).warning(
                "the MLflow runs are not ended %s (%s); the ledger says how the run ended", state, describe_error(err)
            )


def record_pause(spec: CampaignSpec, flow_run: str, stage: str, step: int, reason: str) -> CampaignRecord:
    """Record the campaign *paused at ``stage`` step ``step``* (its newest good checkpoint; 0:
    none yet) by run ``flow_run``, because ``reason``; its MLflow runs are left *scheduled* (the
    next run sets them running again and goes on)."""
    ledger = Ledger.of_spec(spec)
    cause = f"paused at {stage} step {step}: {reason}"

    def change(r: CampaignRecord) -> None:
        if r.interrupted(flow_run):  # stopped at once meanwhile (grace period, second signal): that stands
            return
        r.status = CampaignStatus.PAUSED
        if r.stages[stage].status in OPEN_STAGES:  # trained but not validated yet: the next run does it
            r.stages[stage].status = StageStatus.PAUSED
        r.end = RunEnd(
            state=CampaignStatus.PAUSED.value, cause=cause, time=time.time(), flow_run=flow_run, stage=stage, step=step
        )

    record = ledger.mutate(change)
    if record.status == CampaignStatus.PAUSED:
        _end_runs(ledger, [stage], CampaignStatus.PAUSED.value, cause, MLFLOW_PAUSED)
    return record


def record_interrupt(spec: CampaignSpec, stop: StopRequest, cause: str, warn) -> None:
    """Record the run ``stop`` belongs to as interrupted, once (the flow and a second signal's
    stop at once may both try). A failure to record (MLflow unreachable) is reported through
    ``warn``, never raised: the stop goes on, and the next run resumes all the same."""
    if stop.flow_run is None:  # stopped before the campaign started: nothing to record
        return

    def record() -> None:
        try:
            close_campaign(spec, "interrupted", cause, stop.flow_run)
        except Exception as e:  # noqa: BLE001 - reported; the stop must not fail on it
            warn(f"could not record the interruption in {spec.workdir_path}: {e}")

    stop.record_once(record)


def pause_cause(workdir: str | Path) -> str:
    """Where and why the campaign in ``workdir`` paused (``paused at main step 40: ...``)."""
    ledger = Ledger.read(CampaignLayout(Path(workdir)))
    end = ledger.record.end if ledger is not None else None
    return end.cause if end is not None and end.state == CampaignStatus.PAUSED else "paused"
