"""What happens to a stage after each of its jobs: the stage policy, pure (no Prefect, no I/O).

The train-stage flow asks it three questions and applies the answers:

- :func:`before_launch` — with the stage's newest good checkpoint: is the stage done, or is a
  launch left in its budget?
- :func:`after_job` — with the job's result: relaunch from the newest good checkpoint, scale
  back up (a planned relaunch that costs no attempt), or give up; and what goes in the ledger.
- :func:`adoptable_attempt` — before a launch: did an earlier flow process die while its job ran
  on a cluster where jobs outlive it? Then that attempt's job is taken back, not launched anew.
- :func:`stage_end` — once no launch follows: trained, or failed with the message for the user.

The flow re-reads the newest good checkpoint before every launch (the validation gate may have
rewound it), so a relaunch always resumes from a checkpoint judged good.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from pretrain.run.incidents import NON_RETRYABLE
from pretrain.state.schema import Failure, Resize, Span, SpanKind

PAUSED = "paused"  # the cause of a job the orchestrator stopped to pause the campaign (``JobResult.cause``)


class Action(StrEnum):
    DONE = "done"  # the stage's last step is committed and good
    LAUNCH = "launch"  # launch (or relaunch) the job from the newest good checkpoint
    CHECK = "check"  # the job ended cleanly: the newest good checkpoint says whether the stage is done
    RELAUNCH = "relaunch"  # the job failed; relaunch it from the newest good checkpoint, budget permitting
    SCALE_UP = "scale_up"  # lost nodes are back: relaunch on all nodes, not counted as an attempt
    GIVE_UP = "give_up"  # relaunching cannot help (or no launch is left): the stage fails
    PAUSE = "pause"  # the run's time budget is spent (or a pause was asked for): stop at the newest good checkpoint


@dataclass(frozen=True)
class Budget:
    """Launches and scale-ups left to the stage in this run of its flow."""

    launches_left: int
    scale_ups_left: int

    @classmethod
    def of(cls, max_attempts: int) -> Budget:
        """``resume.max_attempts`` launches; as many scale-ups (each gives its launch back)."""
        return cls(max_attempts, max_attempts)


class JobEnd(Protocol):
    """What the policy reads of a finished job (``tasks.training.JobResult``)."""

    ok: bool
    cause: str | None
    exit_code: int | None
    duration_s: float
    time_lost_s: float
    errors: list[str]
    log: str
    scaled_up: list[int]
    ended: float | None  # when the orchestrator saw it end


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    budget: Budget
    failure: Failure | None = None  # to record in the ledger
    resize: Resize | None = None  # to record in the ledger


def before_launch(steps: int, good_step: int | None, budget: Budget) -> Decision:
    """Whether to launch the stage's job, given its newest good checkpoint (None: none yet)."""
    if good_step is not None and good_step >= steps:
        return Decision(Action.DONE, f"step {good_step} of {steps} is committed and good", budget)
    if budget.launches_left <= 0:
        return Decision(Action.GIVE_UP, "no launch left (resume.max_attempts)", budget)
    return Decision(
        Action.LAUNCH,
        f"from {'step ' + str(good_step) if good_step is not None else 'the start'}",
        replace(budget, launches_left=budget.launches_left - 1),
    )


def after_job(job: JobEnd, attempt: int, budget: Budget) -> Decision:
    """What follows the end of launch ``attempt`` of the stage's job."""
    if job.ok:
        return Decision(Action.CHECK, "the job ended cleanly", budget)
    if job.cause == PAUSED:  # stopped on purpose, with a save at breakpoint: no failure, no attempt used up
        return Decision(Action.PAUSE, "the job was stopped to pause the campaign", budget)
    if job.cause == "scale_up" and budget.scale_ups_left > 0:
        return Decision(
            Action.SCALE_UP,
            f"node(s) {job.scaled_up} are back",
            Budget(budget.launches_left + 1, budget.scale_ups_left - 1),
            resize=Resize(attempt=attempt, nodes_back=job.scaled_up, duration_s=round(job.duration_s, 2)),
        )
    retryable = job.cause not in NON_RETRYABLE
    failure = Failure(
        attempt=attempt,
        in_job=False,
        cause=job.cause,
        action="relaunch the job" if retryable else "stop",
        exit_code=job.exit_code,
        time_lost_s=round(job.time_lost_s, 2),
        errors=job.errors,
        log=job.log,
        **({"detected_at": job.ended} if job.ended is not None else {}),
    )
    if not retryable:
        return Decision(Action.GIVE_UP, f"{job.cause}: relaunching cannot help, a human must act", budget, failure)
    return Decision(Action.RELAUNCH, f"{job.cause}: relaunch from the newest good checkpoint", budget, failure)


def adoptable_attempt(
    stage: str, attempts: int, spans: Sequence[Span], failures: Sequence[Failure], adopts: bool
) -> int | None:
    """The attempt whose job may still be running without an orchestrator: the stage's last
    launch (of ``attempts``), whose job span opened and never closed, with no failed job recorded
    for it (the flow process that ran it died). None: launch the next attempt — also always on a
    cluster whose jobs die with their orchestrator (``adopts`` False: nothing to take back)."""
    if not adopts or attempts < 1:
        return None
    last = attempts - 1
    jobs = [s for s in spans if s.kind == SpanKind.JOB and s.stage == stage and s.attempt == last]
    if not jobs or any(s.end is not None for s in jobs):
        return None  # never started, or the orchestrator saw it end
    if any(f.attempt == last and not f.in_job for f in failures):
        return None
    return last


@dataclass(frozen=True)
class StageEnd:
    """How the stage ended: trained, or failed with ``message`` for the user."""

    trained: bool
    step: int  # the newest good checkpoint's step (0: none)
    message: str = ""
    cause: str | None = None  # the last job's cause of failure


def stage_end(
    stage: str, steps: int, good_step: int | None, attempts: int, last: JobEnd | None, logs: Path
) -> StageEnd:
    """The stage's end once no launch follows: trained if its last step is committed and good."""
    step = good_step or 0
    if good_step is not None and good_step >= steps:
        return StageEnd(True, step)
    if last is None:
        cause = "unknown"
    elif last.ok:
        cause = "the job ended cleanly without committing a good checkpoint at the last step"
    else:
        cause = f"{last.cause} ({'; '.join(last.errors)})" if last.errors else str(last.cause)
    return StageEnd(
        False,
        step,
        cause=last.cause if last else None,
        message=(
            f"stage {stage} stopped at step {step}/{steps} after {attempts} attempt(s); last failure: {cause}. "
            f"Logs: {logs}. Fix the cause and run the same command again: it resumes from the last good checkpoint."
        ),
    )
