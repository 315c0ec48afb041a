"""Loss anomalies (non-finite loss, spikes) and the sample windows skipped after a rollback.

A spike is a loss whose robust z-score over a trailing window (median and MAD) exceeds a
threshold. On an anomaly at step s rank 0 records the global batch of step s as a skip window
in ``<stage jobs dir>/skips.json``; the workers roll back to the newest snapshot (always before
s: step s is never checkpointed) in process (``trainer.resilience.rollback``), or, with
``rollback_in_process`` off, stop and are restarted, and step over that window.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from pathlib import Path

from trainer.common.atomic import atomic_write_json
from trainer.job.layout import JobLayout


class LossAnomaly(RuntimeError):
    def __init__(self, kind: str, step: int, loss: float, window: tuple[int, int]):
        super().__init__(f"{kind} loss {loss!r} at step {step}; samples {window[0]}..{window[1]} will be skipped")
        self.kind, self.step, self.loss, self.window = kind, step, loss, window


class TooManyRollbacks(RuntimeError):
    """More loss anomalies than the spec allows: a human should look at the data or the lr."""


class SpikeDetector:
    def __init__(self, window: int, zscore: float, min_steps: int):
        self.losses: deque[float] = deque(maxlen=window)
        self.zscore, self.min_steps = zscore, min_steps

    def check(self, loss: float) -> str | None:
        """'nonfinite', 'spike' or None; normal losses join the trailing window."""
        if not math.isfinite(loss):
            return "nonfinite"
        if self.zscore > 0 and len(self.losses) >= self.min_steps:
            med = statistics.median(self.losses)
            mad = statistics.median(abs(x - med) for x in self.losses) * 1.4826
            if mad > 0 and (loss - med) / mad > self.zscore:
                return "spike"
        self.losses.append(loss)
        return None

    def forget(self, steps: int) -> None:
        """Drop the newest ``steps`` losses: a rollback redoes those steps, which then count again."""
        for _ in range(min(max(steps, 0), len(self.losses))):
            self.losses.pop()


def skips_path(job_dir: str | Path) -> Path:
    return JobLayout.of(job_dir).skips


def read_skips(job_dir: str | Path) -> list[dict]:
    try:
        return json.loads(skips_path(job_dir).read_text())
    except FileNotFoundError:
        return []


def record_skip(job_dir: str | Path, anomaly: LossAnomaly) -> None:
    skips = read_skips(job_dir)
    if not any(s["start"] == anomaly.window[0] for s in skips):
        skips.append(
            {
                "start": anomaly.window[0],
                "end": anomaly.window[1],
                "kind": anomaly.kind,
                "step": anomaly.step,
                "loss": repr(anomaly.loss),
                "pid": os.getpid(),
            }
        )
        atomic_write_json(skips_path(job_dir), skips)


def skip_past(consumed: int, windows: list[tuple[int, int]]) -> int:
    """The first sample position at or after ``consumed`` that is in no skip window."""
    moved = True
    while moved:
        moved = False
        for start, end in windows:
            if start <= consumed < end:
                consumed, moved = end, True
    return consumed
