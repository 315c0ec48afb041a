"""The metrics forwarder: tails a job's ``metrics.jsonl`` (and its checkpoint events) into the
stage's and the campaign's MLflow runs (:mod:`pretrain.tracking.runs`), while MLflow may come and
go; :mod:`pretrain.tracking.forwarder` runs it in a thread of its own."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Metric

from pretrain.settings import PretrainSettings
from pretrain.tracking.health import MlflowAway
from pretrain.tracking.runs import CAMPAIGN_METRICS, LOG_BATCH, METRIC_KEYS, STAGE_METRICS, Tracker, describe_error
from trainer.common.backoff import Backoff
from trainer.job.events import EventKind
from trainer.job.reporting import read_new_lines

QUIET_S = 60.0  # while MLflow stays away, the forwarder says so at most once in this time


def forwarder_backoff(settings: PretrainSettings) -> Backoff:
    """The metrics forwarder's backoff (``PRETRAIN_FORWARDER_BACKOFF_S`` / ``…_MAX_S``)."""
    return Backoff(settings.forwarder_backoff_s, settings.forwarder_backoff_max_s)


def _log_warning(message: str) -> None:
    logging.getLogger(__name__).warning(message)


@dataclass
class MetricsForwarder:
    """Tails a job's ``metrics.jsonl`` into the stage run (stage step) and the campaign run
    (campaign step = ``step_offset`` + stage step), skipping steps either run already has.

    Telemetry never stops training: while MLflow is away, what was read waits here and ``pump``
    retries with backoff, saying so in one line (again at most once a minute; while its server
    does not answer, each try is one quick request: :meth:`Tracker.away`); once MLflow answers,
    everything catches up. Runs not opened yet (MLflow was away when the stage started: ids
    None) are opened by ``open_runs`` first. No step reaches a run twice: steps a run already
    holds are skipped, and a retried batch repeats identical metrics (step, value, timestamp), which MLflow stores
    once. Damaged lines of the job's files are skipped and counted (``damaged``)."""

    tracker: Tracker
    path: Path
    stage_run_id: str | None
    parent_run_id: str | None
    step_offset: int
    events_path: Path | None = None  # checkpoint events become tags naming the checkpoint
    log: Callable[[str], None] = _log_warning  # one line per problem (outage, damaged lines)
    backoff: Backoff = field(default_factory=lambda: forwarder_backoff(PretrainSettings.from_env()))
    offset: int = 0
    events_offset: int = 0
    last_step: int = -1  # the newest stage step the job reported (or the stage run held)
    damaged: int = 0  # lines of the job's files skipped as damaged
    pending: list[dict] = field(default_factory=list)  # records not yet in both runs
    pending_tags: dict[str, str] = field(default_factory=dict)  # not yet on the stage run
    _logged: dict[str, int] | None = field(default=None, repr=False)  # run id → its highest step; None: not asked
    # tokens seen before this stage (None: read from the campaign run once MLflow answers)
    tokens_offset: int | None = None
    open_runs: Callable[[], tuple[str, str]] | None = None  # opens (campaign run, stage run) when an id is None
    last_error: BaseException | None = field(default=None, repr=False)  # of the last failed try
    _quiet_until: float = field(default=0.0, repr=False)  # no line about a failed try before then

    def pump(self, final: bool = False) -> int:
        """Read what the job wrote since the last call and forward it (``final``: the job has
        ended, take a last line without newline too). Returns how many steps reached the stage
        run now: 0 while MLflow is away or the next try is not due. Never raises for tracking."""
        self._read(final)
        if not (self.pending or self.pending_tags) or not self.backoff.due():
            return 0
        try:
            sent = self._send()
        except Exception as err:  # noqa: BLE001 - whatever tracking fails with, training goes on
            self.last_error = err
            delay = self.backoff.failed()
            if time.monotonic() >= self._quiet_until:  # the first failure, then at most one line a minute
                self._quiet_until = time.monotonic() + QUIET_S
                self.log(
                    f"MLflow tracking failed ({describe_error(err)}); {len(self.pending)} step(s) wait here, "
                    f"next try in {delay:.0f}s; training goes on"
                )
            return 0
        if self.backoff.failures:
            self.log(f"MLflow tracking works again: caught up to step {self.last_step}")
        self.last_error = None
        self.backoff.succeeded()
        self._quiet_until = 0.0
        return sent

    def send_all(self) -> int:
        """Read the whole of the job's (ended) files and send what the runs lack now; raises
        what MLflow fails with. For a catch-up after the job (``tasks.mlflow_sync``)."""
        self._read(final=True)
        return self._send() if self.pending or self.pending_tags else 0

    def drain(self, timeout_s: float) -> bool:
        """After the job: forward the rest, retrying while MLflow is away for up to ``timeout_s``
        (not while its server does not answer at all: a later sync sends the rest). Returns
        whether everything is in MLflow; if not, says once where the rest still is."""
        deadline = time.monotonic() + timeout_s
        self.pump(final=True)
        while (
            (self.pending or self.pending_tags)
            and time.monotonic() + self._wait() < deadline
            and not isinstance(self.last_error, MlflowAway)
        ):
            time.sleep(self._wait())  # the backoff's own delay before the next try
            self.pump(final=True)
        if self.pending or self.pending_tags:
            self.log(
                f"MLflow tracking: {len(self.pending)} step(s) not sent yet; they remain in {self.path}, and "
                "reach MLflow when the campaign next finds it answering (a stage's end, its next run)"
            )
            return False
        return True

    def _wait(self) -> float:
        return max(0.0, self.backoff.next_at - time.monotonic())

    def _read(self, final: bool) -> None:
        new = read_new_lines(self.path, self.offset, final)
        self.offset = new.offset
        records = [r for r in new.records if _is_step_record(r)]
        self._count_damaged(self.path, new.damaged + len(new.records) - len(records))
        self.pending += records
        self.last_step = max([self.last_step] + [r["step"] for r in records])
        if self.events_path is None:
            return
        new = read_new_lines(self.events_path, self.events_offset, final)
        self.events_offset = new.offset
        ckpts = [e for e in new.records if e.get("event") == EventKind.CHECKPOINT]
        good = [e for e in ckpts if _is_int(e.get("step")) and isinstance(e.get("path"), str)]
        self._count_damaged(self.events_path, new.damaged + len(ckpts) - len(good))
        if good:
            self.pending_tags.update({f"checkpoint.{e['step']:08d}": e["path"] for e in good})
            self.pending_tags["checkpoint.latest"] = good[-1]["path"]

    def _count_damaged(self, path: Path, n: int) -> None:
        if n:
            self.damaged += n
            self.log(f"skipped {n} damaged line(s) of {path} ({self.damaged} so far in this job)")

    def _send(self) -> int:
        if self.backoff.failures or self.stage_run_id is None or self.parent_run_id is None:
            self.tracker.check()  # one quick request, not MLflow's minutes of retries
        if self.stage_run_id is None or self.parent_run_id is None:
            if self.open_runs is None:
                raise ValueError("the stage's MLflow runs are not known and cannot be opened here")
            self.parent_run_id, self.stage_run_id = self.open_runs()
        if self._logged is None:  # asked once MLflow answers, not when the job starts
            self._logged = {run: self.tracker.max_step(run) for run in (self.stage_run_id, self.parent_run_id)}
            self.last_step = max(self.last_step, self._logged[self.stage_run_id])
        if (
            self.tokens_offset is None
        ):  # the tokens of the stages before this one: the campaign run's count at its start
            held = [
                m
                for m in self.tracker.client.get_metric_history(self.parent_run_id, "tokens_seen")
                if m.step <= self.step_offset
            ]
            self.tokens_offset = int(max(held, key=lambda m: m.step).value) if held and self.step_offset else 0
        sent = self._send_to(self.stage_run_id, 0, METRIC_KEYS, 0)
        self._send_to(self.parent_run_id, self.step_offset, CAMPAIGN_METRICS, self.tokens_offset)
        self.pending = []
        if self.pending_tags:
            self.tracker.set_tags(self.stage_run_id, self.pending_tags)
            self.pending_tags = {}
        return sent

    def _send_to(self, run_id: str, offset: int, keys: tuple[str, ...], tokens_offset: int) -> int:
        """Log the pending steps ``run_id`` lacks (at step + ``offset``), oldest first, in batches;
        the run's high-water mark moves with each batch, so a retry resends only what failed.
        ``tokens_seen`` counts from ``tokens_offset``."""
        high, steps = self._logged[run_id], []
        for r in self.pending:
            if offset + r["step"] > high:  # a step re-run after an in-job restart keeps its first values
                high = offset + r["step"]
                values = {k: r[STAGE_METRICS[k]] for k in keys if STAGE_METRICS[k] in r}
                if "tokens_seen" in values:
                    values["tokens_seen"] += tokens_offset
                steps.append((high, [Metric(k, float(v), int(r["time"] * 1000), high) for k, v in values.items()]))
        per_batch = LOG_BATCH // len(keys)
        for i in range(0, len(steps), per_batch):
            batch = steps[i : i + per_batch]
            self.tracker.log_metrics(run_id, [m for _, ms in batch for m in ms])
            self._logged[run_id] = batch[-1][0]
        return len(steps)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_step_record(r: dict) -> bool:
    """A metrics line the forwarder can use: an integer step, a time, numbers for the metrics."""
    numbers = [r.get("time")] + [r[k] for k in STAGE_METRICS.values() if k in r]
    return _is_int(r.get("step")) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers)
