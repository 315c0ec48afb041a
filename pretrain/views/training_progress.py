"""Where a training stage stands while its job runs, read from the job's own files: the step of
the stage's total, loss, tokens/s, an ETA, restarts so far and the newest checkpoint with the
validation gate's verdict.

One reader for every place that shows it: the training task (flow-run log lines and the Prefect
progress artifact), ``pretrain run``'s console and ``pretrain status --watch`` in another terminal.
It tails ``metrics.jsonl`` / ``events.jsonl`` by byte offset (damaged lines are skipped, as
everywhere) and takes verdicts and earlier restarts from the ledger's stage record.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.console_progress import clock_time, human
from pretrain.state.schema import StageRecord
from pretrain.views.recovery_notes import RecoveryNotes
from trainer.job.events import EventKind, replaced_workers
from trainer.job.layout import JobLayout
from trainer.job.reporting import read_new_lines

PROGRESS_RECORD = (
    "training_progress"  # the attribute of a progress log record: a console that draws its own display drops them
)


def progress_extra() -> dict:
    """``extra`` of a progress log line, which marks it as one."""
    return {PROGRESS_RECORD: True}


ETA_WINDOW_S = 60.0  # the ETA follows the step rate of the last this-many seconds of training


@dataclass(frozen=True)
class TrainingSnapshot:
    """One look at a training stage."""

    stage: str
    attempt: int  # 0 for the first launch of the stage's job
    step: int  # the newest stage step the job reported; -1: none yet
    total: int  # the stage's steps
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None  # None until the job has trained for a while
    restarts: int = 0  # relaunches of the job plus in-job restarts and lost workers replaced, over all attempts
    checkpoint_step: int | None = None  # the newest committed checkpoint of the stage
    checkpoint_verdict: str | None = None  # good / bad / pending (not judged yet)

    @property
    def done(self) -> int:
        return max(self.step, 0)

    @property
    def percent(self) -> float:
        return round(100.0 * min(self.done, self.total) / self.total, 1) if self.total else 0.0

    def fields(self) -> dict[str, str | int]:
        """The numbers beside step / total, as a progress display shows them."""
        out: dict[str, str | int] = {}
        if self.loss is not None:
            out["loss"] = f"{self.loss:.4g}"
        if self.tokens_per_s is not None:
            out["tok/s"] = human(self.tokens_per_s)
        if self.eta_s is not None:
            out["ETA"] = clock_time(self.eta_s)
        out["restarts"] = self.restarts
        if self.checkpoint_step is not None:
            out["checkpoint"] = f"{self.checkpoint_step} {self.checkpoint_verdict}"
        return out

    def line(self) -> str:
        """``stage main: step 40/200 (20.0%), loss 3.214, tok/s 12.3k, ETA 0:01:10, restarts 0, checkpoint 40 good``."""
        head = f"stage {self.stage}: step {self.done}/{self.total} ({self.percent}%)"
        return ", ".join([head] + [f"{k} {v}" for k, v in self.fields().items()])


@dataclass
class StepRate:
    """Steps per second over the job's own timestamps (the newest ``window_s``): the ETA holds for
    a follower that started late, and it starts again after a restart moves the step back."""

    window_s: float = ETA_WINDOW_S
    samples: deque = field(default_factory=deque)  # (time, step)

    def add(self, t: float, step: int) -> None:
        if self.samples and step < self.samples[-1][1]:
            self.samples.clear()  # resumed from an older checkpoint: the old pace says nothing
        self.samples.append((t, step))
        while len(self.samples) > 2 and t - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def per_s(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _int(x) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


@dataclass
class TrainingWatch:
    """Follows one attempt of a stage's job. ``stage_record`` gives the ledger's current record of
    the stage (None: unknown), for the verdicts and the restarts of earlier attempts."""

    job_dir: Path
    stage: str
    attempt: int
    total: int
    stage_record: Callable[[], StageRecord | None] = lambda: None
    rate: StepRate = field(default_factory=StepRate)
    metrics_offset: int = 0
    events_offset: int = 0
    step: int = -1
    loss: float | None = None
    tokens_per_s: float | None = None
    job_restarts: int = 0  # the newest restart_count a worker started with in this attempt
    job_replacements: int = 0  # lost workers replaced while the others kept running (fast recoveries)
    checkpoint_step: int | None = None
    recoveries: RecoveryNotes = field(default_factory=RecoveryNotes)
    notes: deque = field(default_factory=lambda: deque(maxlen=100))  # recoveries seen and not yet taken (take_notes)
    earlier_restarts: int | None = (
        None  # the ledger's restarts when first read: earlier attempts' (a job's own are added when it ends)
    )

    def poll(self, final: bool = False) -> TrainingSnapshot:
        """Read what the job wrote since the last call (``final``: the job ended, take a last
        unterminated line too) and say where the stage stands."""
        self._read_metrics(final)
        self._read_events(final)
        record = self._record()
        if self.earlier_restarts is None and record is not None:
            self.earlier_restarts = record.restarts
        # once the job ended the ledger counts its restarts too: counted once, not again beside the job's own
        restarts = max(
            record.restarts if record else 0, (self.earlier_restarts or 0) + self.job_restarts + self.job_replacements
        )
        ckpt = self.checkpoint_step
        if ckpt is None and record and record.good_checkpoint:
            ckpt = record.good_checkpoint.step  # nothing committed in this attempt yet: where it resumed from
        rate = self.rate.per_s()
        eta = (self.total - self.step) / rate if rate and 0 <= self.step < self.total else None
        return TrainingSnapshot(
            stage=self.stage,
            attempt=self.attempt,
            step=self.step,
            total=self.total,
            loss=self.loss,
            tokens_per_s=self.tokens_per_s,
            eta_s=eta,
            restarts=self.attempt + restarts,
            checkpoint_step=ckpt,
            checkpoint_verdict=None if ckpt is None else _verdict(record, ckpt),
        )

    def _record(self) -> StageRecord | None:
        try:
            return self.stage_record()
        except Exception:  # noqa: BLE001 - a ledger being replaced or damaged: the job's own numbers still show
            return None

    def _read_metrics(self, final: bool) -> None:
        new = read_new_lines(JobLayout(self.job_dir).metrics, self.metrics_offset, final)
        self.metrics_offset = new.offset
        for r in new.records:
            step, t = _int(r.get("step")), _number(r.get("time"))
            if step is None:
                continue
            self.step = step  # lower than before after a restart from an older checkpoint: the step it is at
            self.loss = _number(r.get("loss")) if "loss" in r else self.loss
            self.tokens_per_s = _number(r.get("tokens_per_s")) if "tokens_per_s" in r else self.tokens_per_s
            if t is not None:
                self.rate.add(t, step)

    def _read_events(self, final: bool) -> None:
        new = read_new_lines(JobLayout(self.job_dir).events, self.events_offset, final)
        self.events_offset = new.offset
        for e in new.records:
            if e.get("event") == EventKind.CHECKPOINT and _int(e.get("step")) is not None:
                self.checkpoint_step = max(self.checkpoint_step or 0, e["step"])
            elif e.get("event") == EventKind.START and _int(e.get("restart_count")) is not None:
                self.job_restarts = max(self.job_restarts, e["restart_count"])
            elif replaced_workers(e):
                self.job_replacements += 1
            if (note := self.recoveries.note(e)) is not None:
                self.notes.append(note)

    def take_notes(self) -> list[str]:
        """The recoveries read since the last call, one line each (``pretrain.views.recovery_notes``)."""
        taken = list(self.notes)
        self.notes.clear()
        return taken


def _verdict(record: StageRecord | None, step: int) -> str:
    verdicts = [v.verdict for v in (record.verdicts if record else []) if v.step == step]
    if verdicts:
        return verdicts[-1]
    if record and record.good_checkpoint and record.good_checkpoint.step == step:
        return "good"
    return "pending"


def job_watch(
    root: Path, stage: str, attempt: int, total: int, stage_record: Callable[[], StageRecord | None]
) -> TrainingWatch:
    """A watch of the job directory the campaign layout gives the stage's ``attempt``."""
    from pretrain.spec.layout import CampaignLayout

    return TrainingWatch(CampaignLayout(root).job_dir(stage, attempt), stage, attempt, total, stage_record)


@dataclass
class Throttle:
    """True at most once every ``interval_s`` (and on the first call)."""

    interval_s: float
    clock: Callable[[], float] = time.monotonic
    last: float | None = None

    def due(self) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.interval_s:
            return False
        self.last = now
        return True
