"""MLflow tracking of a campaign: one parent run, one nested run per stage.

Runs are found again by tags (campaign id + role + stage), never by Prefect's flow-run id, so
a re-run after a crash reattaches to the same runs. Metrics are deduplicated against what the
run already holds (its highest logged step), so no step is logged twice after a resume.
Uses ``MlflowClient`` only (no fluent API global state). A job's metrics reach these runs
through the forwarder of :mod:`pretrain.tracking.metrics`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from pretrain.redact import redact, redact_mapping, redact_value
from pretrain.tracking.health import MlflowAway, mlflow_away
from pretrain.tracking.store import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG

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
LOG_BATCH = 900  # log_batch accepts at most 1000 metrics


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
    for i in range(0, len(new), LOG_BATCH):
        client.log_batch(run_id, metrics=new[i : i + LOG_BATCH])


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
        for i in range(0, len(metrics), LOG_BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + LOG_BATCH])

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
