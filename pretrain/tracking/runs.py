"""MLflow tracking of a campaign: one parent run, one nested run per stage.

Runs are found again by tags (campaign id + role + stage), never by Prefect's flow-run id, so
a re-run after a crash reattaches to the same runs. Metrics are deduplicated against what the
run already holds (its highest logged step), so no step is logged twice after a resume.
Uses ``MlflowClient`` only (no fluent API global state).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from pretrain.redact import redact, redact_mapping, redact_value
from pretrain.settings import PretrainSettings
from pretrain.tracking.health import MlflowAway, mlflow_away
from pretrain.tracking.store import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG
from trainer.common.backoff import Backoff
from trainer.job.events import EventKind
from trainer.job.reporting import read_new_lines

TAG_CAMPAIGN_ID = "pretrain.campaign_id"
TAG_CAMPAIGN = "pretrain.campaign"
TAG_ROLE = "pretrain.role"
TAG_STAGE = "pretrain.stage"
TAG_SPEC_HASH = "pretrain.spec_hash"
TAG_WORKDIR = "pretrain.workdir"
# Stable metric keys (docs/tracking.md): the stage run's metric → the job's metrics.jsonl field.
STAGE_METRICS = {
    "loss": "loss",
    "lr": "lr",
    "grad_norm": "grad_norm",
    "step_time": "step_time",
    "tokens_per_s": "tokens_per_s",
    "tokens_seen": "tokens",
    "checkpoint_block_s": "ckpt_block_s",
}
CAMPAIGN_METRICS = ("loss", "lr", "tokens_seen")  # also on the campaign run, at campaign steps
METRIC_KEYS = tuple(STAGE_METRICS)
_BATCH = 900  # log_batch accepts at most 1000 metrics
QUIET_S = 60.0  # while MLflow stays away, the forwarder says so at most once in this time


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = redact_value(key, v)[:6000]
    return out


def metrics_at(values: dict[str, float], step: int) -> list[Metric]:
    now = int(time.time() * 1000)
    return [Metric(k, float(v), now, step) for k, v in values.items()]


def log_to_run(tracking_uri: str | None, run_id: str, values: dict[str, float], step: int) -> None:
    """Log ``values`` at ``step`` to an existing run (``tracking_uri`` None: MLflow's default,
    e.g. ``MLFLOW_TRACKING_URI``). Fails if the run does not exist."""
    client = MlflowClient(tracking_uri=tracking_uri)
    client.get_run(run_id)  # a clear "run not found" before anything is written
    log_once(client, run_id, values, step)


def logged_at(client: MlflowClient, run_id: str, keys, step: int) -> dict[str, Metric]:
    """What the run already holds at ``step`` of each of ``keys``."""
    held = {}
    for key in keys:
        held.update({m.key: m for m in client.get_metric_history(run_id, key) if m.step == step})
    return held


def log_once(client: MlflowClient, run_id: str, values: dict[str, float], step: int) -> None:
    """Log the ``values`` the run does not hold at ``step`` yet: a run never holds two values of
    one metric at one step, however often this runs (a retried task, a resumed campaign)."""
    log_once_at_steps(client, run_id, {step: values})


def log_once_at_steps(client: MlflowClient, run_id: str, values_by_step: dict[int, dict[str, float]]) -> None:
    """:func:`log_once` for values at several steps: each metric's history is read once."""
    keys = {k for values in values_by_step.values() for k in values}
    held = {(m.key, m.step) for key in sorted(keys) for m in client.get_metric_history(run_id, key)}
    new = [
        m
        for step, values in sorted(values_by_step.items())
        for m in metrics_at({k: v for k, v in values.items() if (k, step) not in held}, step)
    ]
    for i in range(0, len(new), _BATCH):
        client.log_batch(run_id, metrics=new[i : i + _BATCH])


@dataclass
class Tracker:
    tracking_uri: str
    experiment: str
    artifact_dir: Path
    client: MlflowClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = MlflowClient(tracking_uri=self.tracking_uri)  # no request yet: MLflow may be away

    @cached_property
    def experiment_id(self) -> str:
        """The experiment's id, created on first use; tagged as a model-training experiment (MLflow
        3's UI then opens it in its training view) — also an existing one that lacks the tag."""
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            return self.client.create_experiment(
                self.experiment,
                artifact_location=Path(self.artifact_dir).resolve().as_uri(),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id

    def _find(self, tags: dict[str, str]) -> str | None:
        flt = " AND ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=flt, max_results=2, order_by=["attributes.start_time ASC"]
        )
        return runs[0].info.run_id if runs else None

    def _ensure(
        self,
        tags: dict[str, str],
        name: str,
        params: dict[str, str],
        extra_tags: dict[str, str],
        current: dict[str, str] | None = None,
    ) -> str:
        """The run with ``tags``, created with ``extra_tags`` and ``params`` if there is none; the
        ``current`` tags are set on a found run too (what may have changed since it was created)."""
        run_id = self._find(tags)
        if run_id is None:
            run = self.client.create_run(
                self.experiment_id, run_name=name, tags=redact_mapping({**tags, **extra_tags, **(current or {})})
            )
            run_id = run.info.run_id
            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), 90):
                self.client.log_batch(run_id, params=items[i : i + 90])
        else:
            self.client.update_run(run_id, status="RUNNING")
            if current:
                self.set_tags(run_id, current)
        return run_id

    def campaign_run(
        self, campaign_id: str, name: str, spec_hash: str, params: dict, workdir: Path | None = None
    ) -> str:
        """The campaign's run; its ``pretrain.workdir`` tag says where the campaign ran last (a
        moved campaign's new place: ``pretrain compare RUN_ID`` reads the ledger there)."""
        return self._ensure(
            {TAG_CAMPAIGN_ID: campaign_id, TAG_ROLE: "campaign"},
            name,
            flatten(params),
            {TAG_CAMPAIGN: name, TAG_SPEC_HASH: spec_hash},
            {TAG_WORKDIR: str(workdir)} if workdir else None,
        )

    def last_workdir(self, campaign_id: str) -> str | None:
        """Where the campaign's run says the campaign ran last (None: no run yet, or no tag)."""
        run_id = self._find({TAG_CAMPAIGN_ID: campaign_id, TAG_ROLE: "campaign"})
        return self.client.get_run(run_id).data.tags.get(TAG_WORKDIR) if run_id else None

    def stage_run(self, campaign_id: str, parent_run_id: str, campaign: str, stage: str, params: dict) -> str:
        return self._ensure(
            {TAG_CAMPAIGN_ID: campaign_id, TAG_ROLE: "stage", TAG_STAGE: stage},
            f"{campaign}/{stage}",
            flatten(params, "stage."),
            {MLFLOW_PARENT_RUN_ID: parent_run_id, TAG_CAMPAIGN: campaign, MLFLOW_RUN_NAME: f"{campaign}/{stage}"},
        )

    def away(self) -> str | None:
        """Why MLflow cannot be used now (one quick request), or None (:mod:`pretrain.tracking.health`)."""
        return mlflow_away(self.tracking_uri, self.client)

    def check(self) -> None:
        """Raise :class:`MlflowAway` at once (one quick request) if MLflow does not answer now."""
        if why := self.away():
            raise MlflowAway(f"MLflow at {redact(self.tracking_uri)} does not answer ({why})")

    def max_step(self, run_id: str, key: str = "loss") -> int:
        history = self.client.get_metric_history(run_id, key)
        return max((m.step for m in history), default=-1)

    def log_metrics(self, run_id: str, metrics: list[Metric]) -> None:
        for i in range(0, len(metrics), _BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + _BATCH])

    def log_values(self, run_id: str, values: dict[str, float], step: int) -> None:
        """Log ``values`` at ``step``, except those the run already holds there."""
        log_once(self.client, run_id, values, step)

    def log_values_at_steps(self, run_id: str, values_by_step: dict[int, dict[str, float]]) -> None:
        """:meth:`log_values` for several steps at once (each metric's history read once)."""
        log_once_at_steps(self.client, run_id, values_by_step)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in redact_mapping(tags).items()])

    def finish(self, run_id: str, status: str) -> None:
        """End the run with ``status`` now. As ``MlflowClient.set_terminated`` does, less its
        extra request and the "🏃 View run … at" line it writes to stdout (through a progress
        line on the console) for a server's runs: the campaign says where its runs are itself."""
        self.client._tracking_client.store.update_run_info(
            run_id, run_status=RunStatus.from_string(status), end_time=int(time.time() * 1000), run_name=None
        )


def transient(err: BaseException) -> bool:
    """Worth retrying: MLflow unreachable, timing out or failing on its side (5xx), not a
    request it refuses (a missing run, an invalid value)."""
    if isinstance(err, MlflowException):
        return err.get_http_status_code() >= 500
    return isinstance(err, OSError)  # connection errors (requests' are OSErrors too), a full disk


def describe_error(err: BaseException, limit: int = 300) -> str:
    """One line for a log: the error's type and the start of its first line, with anything
    credential-shaped masked (:func:`pretrain.redact.redact`)."""
    text = redact((str(err).strip().splitlines() or [""])[0])
    text = f"{text[:limit]}{'…' if len(text) > limit else ''}"
    return text if isinstance(err, MlflowAway) else f"{type(err).__name__}: {text}"  # it says what it is


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
    holds are skipped, and a retried batch repeats identical metrics (step, value, timestamp), which MLflow stores once. Damaged
    lines of the job's files are skipped and counted (``damaged``)."""

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
    tokens_offset: int | None = (
        None  # tokens seen before this stage (None: read from the campaign run once MLflow answers)
    )
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
        per_batch = _BATCH // len(keys)
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
