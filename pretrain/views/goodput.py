"""The goodput split: every second of a campaign's (and each stage's) wall time in exactly one
category, so the parts add up to the wall time. Goodput = productive / wall.

Read from the workdir only: the ledger's timed spans (runs, stages, jobs, data preparation,
node check, validation and evaluation), its failures, and each job's ``metrics.jsonl`` (step
times, checkpoint blocking) and ``events.jsonl`` (worker starts with their resume step).

How: each source gives intervals of a category; an instant covered by several goes to the one
first in :data:`CATEGORIES` (a step's own measured time beats the recovery window around it),
an instant covered by none is ``idle`` (orchestration: Prefect, MLflow, the gate's waits).
A ledger written before spans were recorded has no wall time to split: reported as unknown,
never guessed.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.run.incidents import incidents
from pretrain.spec.layout import CampaignLayout
from pretrain.state.schema import CampaignRecord, CampaignStatus, Span, SpanKind
from trainer.job.events import EventKind
from trainer.job.layout import JobLayout
from trainer.job.reporting import read_all

# in priority order: an instant covered by several categories goes to the first
CATEGORIES = (
    "productive",
    "recomputation",
    "checkpoint_blocking",
    "detection",
    "recovery",
    "node_checks",
    "validation_eval",
    "registration",
    "data_preparation",
    "provisioning",
)
IDLE = "idle"  # idle / orchestration: the remainder
ALL = (*CATEGORIES, IDLE)
DESCRIPTIONS = {
    "productive": "training steps whose results survived",
    "recomputation": "steps redone after a fault (their first run was lost)",
    "checkpoint_blocking": "training blocked taking a checkpoint (snapshot; the final flush)",
    "detection": "from the last step before a fault until it was noticed",
    "recovery": "restart, rendezvous, restore; a relaunched job until it stepped again",
    "node_checks": "provisioning the cluster: node health checks",
    "validation_eval": "validating and evaluating a stage's final checkpoint",
    "registration": "exporting the final model and registering it in MLflow",
    "data_preparation": "preparing (or checking) the data set",
    "provisioning": "a job's launch until its first step (processes, imports, data loading)",
    IDLE: "orchestration and waiting: everything else",
}

Interval = tuple[str, float, float]  # (category, start, end)
NOTICES = (EventKind.HANG, EventKind.ANOMALY, EventKind.ERROR, EventKind.NODE_LOST)  # a fault noticed (a drill is not)


def split(windows: list[tuple[float, float]], intervals: list[Interval]) -> dict[str, float]:
    """Seconds of each category (and ``idle``) inside ``windows``: an instant goes to the
    first category of :data:`CATEGORIES` covering it, else to idle. The parts add up to the
    windows' total length (overlapping windows count once)."""
    rank = {c: i for i, c in enumerate(CATEGORIES)}
    marks: list[tuple[float, int, int]] = []  # (time, +1/-1, category index; len(CATEGORIES): a window)
    for start, end in windows:
        if end > start:
            marks += [(start, 1, len(CATEGORIES)), (end, -1, len(CATEGORIES))]
    for cat, start, end in intervals:
        if end > start:
            marks += [(start, 1, rank[cat]), (end, -1, rank[cat])]
    marks.sort()
    counts = [0] * (len(CATEGORIES) + 1)
    parts = dict.fromkeys(ALL, 0.0)
    prev = None
    for t, delta, idx in marks:
        if prev is not None and t > prev and counts[-1] > 0:
            cat = next((CATEGORIES[i] for i in range(len(CATEGORIES)) if counts[i] > 0), IDLE)
            parts[cat] += t - prev
        counts[idx] += delta
        prev = t
    return parts


@dataclass
class JobStreams:
    """One launch of a stage's job: what its workers wrote."""

    attempt: int
    events: list[dict] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)

    @classmethod
    def read(cls, job_dir: Path, attempt: int) -> JobStreams:
        def valid(records: list[dict], keys: tuple[str, ...]) -> list[dict]:
            return sorted(
                (r for r in records if all(isinstance(r.get(k), (int, float)) for k in keys)), key=lambda r: r["time"]
            )

        return cls(
            attempt,
            valid(read_all(JobLayout(job_dir).events), ("time",)),
            valid(read_all(JobLayout(job_dir).metrics), ("time", "step", "step_time")),
        )

    def starts(self) -> list[dict]:
        """Rank 0's (re)starts and in-process rollbacks: each begins a run of steps from its ``step``
        (a rollback's ``step`` is the one it restored)."""
        return [
            e
            for e in self.events
            if e.get("event") in (EventKind.START, EventKind.ROLLBACK)
            and e.get("rank") == 0
            and isinstance(e.get("step"), int)
        ]

    def first_step_at(self) -> float | None:
        return self.metrics[0]["time"] if self.metrics else None

    def last_step_before(self, t: float) -> float | None:
        return max((m["time"] for m in self.metrics if m["time"] <= t), default=None)


def read_jobs(layout: CampaignLayout, stage: str) -> list[JobStreams]:
    """Every attempt's streams of ``stage`` (damaged lines skipped; missing files: empty)."""
    root = layout.root / "jobs" / stage
    jobs = []
    for d in sorted(root.glob("attempt_*")) if root.is_dir() else ():
        try:
            jobs.append(JobStreams.read(d, int(d.name.removeprefix("attempt_"))))
        except ValueError:
            continue  # not a job directory of ours
    return jobs


def step_intervals(jobs: list[JobStreams]) -> list[Interval]:
    """Each logged step's compute (productive, or recomputation if a later restart went back
    before it) and its checkpoint blocking; a job's final flush (last step → done) blocks too."""
    restarts = sorted((e["time"], e["step"]) for j in jobs for e in j.starts())
    times = [t for t, _ in restarts]
    redone_from = [step for _, step in restarts]  # suffix minimum: the lowest step any later restart went back to
    for i in range(len(redone_from) - 2, -1, -1):
        redone_from[i] = min(redone_from[i], redone_from[i + 1])
    out: list[Interval] = []
    for job in jobs:
        starts, si, seg_start, prev = sorted(job.starts(), key=lambda e: e["time"]), 0, None, None
        for m in job.metrics:
            while si < len(starts) and starts[si]["time"] <= m["time"]:
                seg_start, prev, si = starts[si], None, si + 1  # a (re)start: a new run of steps
            base = prev or seg_start
            prev_step = base["step"] if base else m["step"] - 1
            k = max(1, m["step"] - prev_step)
            block = max(0.0, float(m.get("ckpt_block_s") or 0.0))
            end = m["time"] - block
            begin = max(base["time"] if base else float("-inf"), end - k * max(0.0, float(m["step_time"])))
            out.append(("checkpoint_blocking", end, m["time"]))
            later = bisect.bisect_right(times, m["time"])
            survives_to = redone_from[later] if later < len(redone_from) else m["step"]
            kept = min(1.0, max(0.0, (survives_to - prev_step) / k))
            cut = begin + kept * (end - begin)
            out += [("productive", begin, cut), ("recomputation", cut, end)]
            prev = m
        done = [e["time"] for e in job.events if e.get("event") == EventKind.DONE and e.get("rank") == 0]
        if done and job.metrics:
            out.append(("checkpoint_blocking", job.metrics[-1]["time"], max(done)))
    return out


def fault_intervals(
    jobs: list[JobStreams], failures: list[dict], job_spans: dict[int, tuple[float, float]]
) -> list[Interval]:
    """Detection (last step → fault noticed) and recovery (noticed → stepping again) of every
    fault: in-job restarts from the job's streams, failed jobs from the ledger's failures."""
    by_attempt = {j.attempt: j for j in jobs}
    out: list[Interval] = []
    for job in jobs:
        for inc in incidents(job.events, job.metrics, job.attempt):
            first, recovery = inc["detected_at"], inc["recovery_s"]  # the first fault event (a drill: the fault itself)
            if recovery is None:
                continue  # a saver restart: training did not stop
            resumed = first + recovery
            noticed = min(
                (e["time"] for e in job.events if first <= e["time"] <= resumed and e.get("event") in NOTICES),
                default=first,
            )  # a hang: step_timeout_s later
            last = job.last_step_before(first)
            out += [("detection", last if last is not None else first, noticed), ("recovery", noticed, resumed)]
    for f in failures:
        detected = f.get("detected_at")
        if f.get("in_job") or not isinstance(detected, (int, float)):
            continue
        job = by_attempt.get(f.get("attempt"))
        last = job.last_step_before(detected) if job else None
        out.append(("detection", last if last is not None else detected, detected))
        nxt = by_attempt.get((f.get("attempt") or 0) + 1)
        resumed = nxt.first_step_at() if nxt else None
        if resumed is None and (f.get("attempt") or 0) + 1 in job_spans:
            resumed = job_spans[f["attempt"] + 1][1]  # the relaunch never stepped: all of it was recovery
        if resumed is not None:
            out.append(("recovery", detected, resumed))
    return out


def span_end(span: Span, record: CampaignRecord, now: float, live: bool = False) -> float:
    """A span's end; an open one ends now while the campaign runs (``live``: the caller is the
    run itself), else at the last time the ledger knows of (the process recording it died)."""
    if span.end is not None:
        return span.end
    if live or record.status in (CampaignStatus.RUNNING, CampaignStatus.NEW):
        return now
    known = [s.end for s in record.spans if s.end is not None] + [s.start for s in record.spans]
    known += [record.end.time] if record.end is not None and record.end.time else []
    return max([t for t in known if t >= span.start], default=span.start)


@dataclass
class Goodput:
    """The split of one wall time (a stage's or the campaign's)."""

    wall_s: float | None  # None: unknown (see ``missing``)
    parts_s: dict[str, float]
    missing: list[str] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        return self.parts_s["productive"] / self.wall_s if self.wall_s else None

    def to_json(self) -> dict:
        return {
            "known": self.wall_s is not None,
            "wall_s": None if self.wall_s is None else round(self.wall_s, 3),
            "goodput": None if self.goodput is None else round(self.goodput, 4),
            "parts_s": {k: round(v, 3) for k, v in self.parts_s.items()},
            "missing": self.missing,
        }


def _of(windows: list[tuple[float, float]], intervals: list[Interval], missing: list[str]) -> Goodput:
    if not windows:
        return Goodput(None, dict.fromkeys(ALL, 0.0), missing)
    parts = split(windows, intervals)
    return Goodput(sum(parts.values()), parts, missing)


def goodput_report(
    record: CampaignRecord, layout: CampaignLayout, now: float | None = None, live: bool = False
) -> dict:
    """``{"campaign": <split>, "stages": {name: <split>}}``, each split as :meth:`Goodput.to_json`.
    ``live``: called by the campaign's run itself (its open spans end now)."""
    now = time.time() if now is None else now
    spans = [(s, span_end(s, record, now, live)) for s in record.spans if isinstance(s.start, (int, float))]
    ledger_intervals = [
        (cat, s.start, end)
        for s, end in spans
        for kind, cat in (
            (SpanKind.NODE_CHECK, "node_checks"),
            (SpanKind.DATA_PREPARATION, "data_preparation"),
            (SpanKind.VALIDATION_EVAL, "validation_eval"),
            (SpanKind.REGISTRATION, "registration"),
        )
        if s.kind == kind
    ]
    no_spans = (
        []
        if record.spans
        else [
            "the ledger has no timed spans (written by a release before goodput was "
            "recorded): wall time unknown; runs from now on are measured"
        ]
    )
    all_intervals, stages = list(ledger_intervals), {}
    for name, stage in record.stages.items():
        jobs = read_jobs(layout, name)
        job_spans = {s.attempt: (s.start, end) for s, end in spans if s.kind == SpanKind.JOB and s.stage == name}
        intervals = step_intervals(jobs) + fault_intervals(
            jobs, [f.model_dump(mode="json") for f in stage.failures], job_spans
        )
        found = {j.attempt: j for j in jobs}
        # a launch whose records are not here (written in another workdir, or lost with the disk of a
        # run that died; not the newest launch, whose job may not have written anything yet): its
        # time is not known to be provisioning, it counts as idle
        lost = sorted(a for a, (_, end) in job_spans.items() if a not in found and (a < max(job_spans) or end < now))
        intervals += [
            ("provisioning", start, found.get(a, JobStreams(a)).first_step_at() or end)
            for a, (start, end) in job_spans.items()
            if a not in lost
        ]
        windows = [(s.start, end) for s, end in spans if s.kind == SpanKind.STAGE and s.stage == name]
        missing = list(no_spans) or ([] if windows else [f"stage {name!r} has not started in a measured run"])
        if lost:
            missing.append(
                f"stage {name!r}: no records of job attempt(s) {', '.join(map(str, lost))} in "
                f"{layout.root / 'jobs' / name} (another workdir's, or lost): their time counts as idle"
            )
        stages[name] = _of(windows, intervals + ledger_intervals, missing).to_json()
        all_intervals += intervals
    runs = [(s.start, end) for s, end in spans if s.kind == SpanKind.RUN]
    missing = no_spans or ([] if runs else ["no run of the campaign was measured"])
    if runs and record.invocations > len(runs):
        missing.append(
            f"{record.invocations - len(runs)} earlier run(s) of the campaign were not measured (a release "
            "before goodput was recorded): the wall time counts the measured runs only"
        )
    campaign = _of(runs, all_intervals, missing)
    return {"campaign": campaign.to_json(), "stages": stages}
