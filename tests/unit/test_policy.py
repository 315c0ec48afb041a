"""The stage policy (pretrain/run/policy.py): what follows each job of a stage, over a table of cases.
Pure functions: no processes, no Prefect, milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pretrain.run.policy import Action, Budget, adoptable_attempt, after_job, before_launch, stage_end
from pretrain.state.schema import Failure, Span, SpanKind


@dataclass
class Job:
    """A finished job, as ``tasks.training.JobResult`` reports it."""

    exit_code: int = 0
    cause: str | None = None
    duration_s: float = 12.345
    time_lost_s: float = 3.456
    errors: list[str] = field(default_factory=list)
    log: str = "/w/jobs/main/attempt_000/node0.log"
    scaled_up: list[int] = field(default_factory=list)
    ended: float | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def failed(cause: str, **kw) -> Job:
    return Job(exit_code=kw.pop("exit_code", 1), cause=cause, **kw)


# (steps, newest good step, budget) → action, budget after
BEFORE_LAUNCH = {
    "fresh stage": (10, None, Budget(2, 2), Action.LAUNCH, Budget(1, 2)),
    "resumes from a good checkpoint": (10, 4, Budget(2, 2), Action.LAUNCH, Budget(1, 2)),
    "last step good": (10, 10, Budget(2, 2), Action.DONE, Budget(2, 2)),
    "done though no launch left": (10, 10, Budget(0, 0), Action.DONE, Budget(0, 0)),
    "no launch left": (10, 4, Budget(0, 2), Action.GIVE_UP, Budget(0, 2)),
    "last launch": (10, 4, Budget(1, 0), Action.LAUNCH, Budget(0, 0)),
}


@pytest.mark.parametrize("case", list(BEFORE_LAUNCH))
def test_before_launch(case):
    steps, good, budget, action, budget_after = BEFORE_LAUNCH[case]
    decision = before_launch(steps, good, budget)
    assert (decision.action, decision.budget) == (action, budget_after)


# (job, budget) → action, budget after, the failure recorded (cause, action) or None, a resize recorded
AFTER_JOB = {
    "success: the pointer decides": (Job(), Budget(1, 2), Action.CHECK, Budget(1, 2), None, False),
    "retryable failure, launches left": (
        failed("worker_failure:exit_1"),
        Budget(1, 2),
        Action.RELAUNCH,
        Budget(1, 2),
        ("worker_failure:exit_1", "relaunch the job"),
        False,
    ),
    "retryable failure, no launch left": (
        failed("hang"),
        Budget(0, 2),
        Action.RELAUNCH,
        Budget(0, 2),
        ("hang", "relaunch the job"),
        False,
    ),  # before_launch then gives up
    "killed by a signal": (
        failed("signal:SIGKILL", exit_code=-9),
        Budget(1, 2),
        Action.RELAUNCH,
        Budget(1, 2),
        ("signal:SIGKILL", "relaunch the job"),
        False,
    ),
    "too many rollbacks": (
        failed("too_many_rollbacks"),
        Budget(1, 2),
        Action.GIVE_UP,
        Budget(1, 2),
        ("too_many_rollbacks", "stop"),
        False,
    ),
    "shm too small": (
        failed("shm_too_small"),
        Budget(1, 2),
        Action.GIVE_UP,
        Budget(1, 2),
        ("shm_too_small", "stop"),
        False,
    ),
    "disk full": (failed("disk_full"), Budget(2, 2), Action.GIVE_UP, Budget(2, 2), ("disk_full", "stop"), False),
    "scale up with scale-ups left": (
        failed("scale_up", scaled_up=[1]),
        Budget(0, 2),
        Action.SCALE_UP,
        Budget(1, 1),
        None,
        True,
    ),  # gives its launch back
    "scale up, none left: a failure": (
        failed("scale_up", scaled_up=[1]),
        Budget(1, 0),
        Action.RELAUNCH,
        Budget(1, 0),
        ("scale_up", "relaunch the job"),
        False,
    ),
}


@pytest.mark.parametrize("case", list(AFTER_JOB))
def test_after_job(case):
    job, budget, action, budget_after, failure, resized = AFTER_JOB[case]
    decision = after_job(job, 3, budget)
    assert (decision.action, decision.budget) == (action, budget_after)
    assert (decision.failure.cause, decision.failure.action) == failure if failure else decision.failure is None
    assert (decision.resize is not None) == resized


def test_a_failed_job_is_recorded_with_what_the_release_before_wrote():
    job = failed("data", errors=["DataError: no window of 60001 tokens"], exit_code=1)
    recorded = after_job(job, 1, Budget(1, 1)).failure.model_dump(mode="json")
    assert recorded == {
        "attempt": 1,
        "in_job": False,
        "cause": "data",
        "action": "relaunch the job",
        "exit_code": 1,
        "time_lost_s": 3.46,
        "errors": ["DataError: no window of 60001 tokens"],
        "log": "/w/jobs/main/attempt_000/node0.log",
    }  # "time" is added when the ledger records it


def test_a_scale_up_records_the_nodes_back():
    recorded = after_job(failed("scale_up", scaled_up=[1, 2]), 2, Budget(1, 1)).resize.model_dump(mode="json")
    assert recorded == {"attempt": 2, "nodes_back": [1, 2], "duration_s": 12.35}


LOGS = Path("/w/jobs/main")
# what the worker raises (the job-level test: tests/unit/test_anomaly.py)
ROLLBACKS = (
    "TooManyRollbacks: 1 loss anomalies in stage main (max_rollbacks=0): ... raise fault_tolerance.max_rollbacks"
)
# (newest good step, last job) → trained, the message's "last failure"
STAGE_END = {
    "last step good": (10, Job(), True, None),
    "failed job, errors reported": (
        4,
        failed("data", errors=["DataError: x", "DataError: y"]),
        False,
        "last failure: data (DataError: x; DataError: y).",
    ),
    "failed job, no errors": (4, failed("hang"), False, "last failure: hang."),
    "too many rollbacks: says which setting": (
        4,
        failed("too_many_rollbacks", errors=[ROLLBACKS]),
        False,
        f"last failure: too_many_rollbacks ({ROLLBACKS}).",
    ),
    "job ended cleanly, pointer short": (4, Job(), False, "last failure: the job ended cleanly without committing"),
    "never launched": (None, None, False, "last failure: unknown."),
}


@pytest.mark.parametrize("case", list(STAGE_END))
def test_stage_end(case):
    good, last, trained, says = STAGE_END[case]
    end = stage_end("main", 10, good, 2, last, LOGS)
    assert end.trained is trained and end.step == (good or 0)
    if not trained:
        assert (
            end.message.startswith(f"stage main stopped at step {good or 0}/10 after 2 attempt(s); ")
            and says in end.message
        )
        assert f"Logs: {LOGS}. Fix the cause and run the same command again" in end.message
        assert end.cause == (last.cause if last else None)


def test_a_stage_is_launched_at_most_max_attempts_times_plus_its_scale_ups():
    """The flow's loop, driven by the policy alone: every job fails but scales up twice."""
    budget, launches, jobs = Budget.of(2), 0, iter([failed("scale_up", scaled_up=[1])] * 2 + [failed("hang")] * 5)
    while (decision := before_launch(10, 4, budget)).action is Action.LAUNCH:
        launches += 1
        budget = after_job(next(jobs), launches, decision.budget).budget
    assert decision.action is Action.GIVE_UP and launches == 4


def job_span(attempt: int, end: float | None = None, stage: str = "main") -> Span:
    return Span(kind=SpanKind.JOB, start=100.0 + attempt, end=end, stage=stage, attempt=attempt)


# (attempts launched, spans, failures, cluster adopts live jobs) → attempt to take back (None: launch the next)
ADOPTABLE = {
    "its flow process died while attempt 1 ran": (
        2,
        [job_span(0, 150.0), job_span(1)],
        [Failure(attempt=0, cause="hang")],
        True,
        1,
    ),
    "the first launch's flow process died": (1, [job_span(0)], [], True, 0),
    "in-job failures of it do not end it": (1, [job_span(0)], [Failure(attempt=0, cause="hang", in_job=True)], True, 0),
    "local cluster: its agents died too": (1, [job_span(0)], [], False, None),
    "never launched": (0, [], [], True, None),
    "its end was seen": (1, [job_span(0, 150.0)], [], True, None),
    "its failure was recorded": (1, [job_span(0)], [Failure(attempt=0, cause="node_lost")], True, None),
    "counted but never started (no span)": (2, [job_span(0, 150.0)], [], True, None),
    "an open span of an earlier attempt only": (2, [job_span(0), job_span(1, 160.0)], [], True, None),
    "an open span of another stage only": (1, [job_span(0, stage="other")], [], True, None),
    "the span of a run, not of a job": (
        1,
        [Span(kind=SpanKind.RUN, start=1.0, stage="main", attempt=0)],
        [],
        True,
        None,
    ),
}


@pytest.mark.parametrize("case", list(ADOPTABLE))
def test_adoptable_attempt(case):
    attempts, spans, failures, adopts, expected = ADOPTABLE[case]
    assert adoptable_attempt("main", attempts, spans, failures, adopts) == expected
