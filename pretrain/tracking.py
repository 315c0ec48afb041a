"""MLflow tracking of a campaign: one parent run, one nested run per stage.

Runs are found again by tags (campaign id + role + stage), never by Prefect's flow-run id, so
a re-run after a crash reattaches to the same runs. Metrics are deduplicated against what the
run already holds (its highest logged step), so no step is logged twice after a resume.
Uses ``MlflowClient`` only (no fluent API global state).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from pretrain.redact import redact_mapping, redact_value
from trainer.reporting import read_new_lines

TAG_CAMPAIGN_ID = "pretrain.campaign_id"
TAG_CAMPAIGN = "pretrain.campaign"
TAG_ROLE = "pretrain.role"
TAG_STAGE = "pretrain.stage"
TAG_SPEC_HASH = "pretrain.spec_hash"
METRIC_KEYS = ("loss", "lr", "grad_norm", "step_time", "tokens_per_s")
_BATCH = 900  # log_batch accepts at most 1000 metrics


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
    client.log_batch(run_id, metrics=metrics_at(values, step))


@dataclass
class Tracker:
    tracking_uri: str
    experiment: str
    artifact_dir: Path
    client: MlflowClient = field(init=False)
    experiment_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        exp = self.client.get_experiment_by_name(self.experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
            self.experiment, artifact_location=Path(self.artifact_dir).resolve().as_uri())

    def _find(self, tags: dict[str, str]) -> str | None:
        flt = " AND ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment_id], filter_string=flt, max_results=2,
                                       order_by=["attributes.start_time ASC"])
        return runs[0].info.run_id if runs else None

    def _ensure(self, tags: dict[str, str], name: str, params: dict[str, str], extra_tags: dict[str, str]) -> str:
        run_id = self._find(tags)
        if run_id is None:
            run = self.client.create_run(self.experiment_id, run_name=name, tags=redact_mapping({**tags, **extra_tags}))
            run_id = run.info.run_id
            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), 90):
                self.client.log_batch(run_id, params=items[i : i + 90])
        else:
            self.client.update_run(run_id, status="RUNNING")
        return run_id

    def campaign_run(self, campaign_id: str, name: str, spec_hash: str, params: dict) -> str:
        return self._ensure({TAG_CAMPAIGN_ID: campaign_id, TAG_ROLE: "campaign"}, name, flatten(params),
                            {TAG_CAMPAIGN: name, TAG_SPEC_HASH: spec_hash})

    def stage_run(self, campaign_id: str, parent_run_id: str, campaign: str, stage: str, params: dict) -> str:
        return self._ensure({TAG_CAMPAIGN_ID: campaign_id, TAG_ROLE: "stage", TAG_STAGE: stage},
                            f"{campaign}/{stage}", flatten(params, "stage."),
                            {MLFLOW_PARENT_RUN_ID: parent_run_id, TAG_CAMPAIGN: campaign, MLFLOW_RUN_NAME: f"{campaign}/{stage}"})

    def max_step(self, run_id: str, key: str = "loss") -> int:
        history = self.client.get_metric_history(run_id, key)
        return max((m.step for m in history), default=-1)

    def log_metrics(self, run_id: str, metrics: list[Metric]) -> None:
        for i in range(0, len(metrics), _BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + _BATCH])

    def log_values(self, run_id: str, values: dict[str, float], step: int) -> None:
        self.log_metrics(run_id, metrics_at(values, step))

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in redact_mapping(tags).items()])

    def finish(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)


@dataclass
class MetricsForwarder:
    """Tails a job's ``metrics.jsonl`` into the stage run (stage step) and the campaign run
    (campaign step = ``step_offset`` + stage step), skipping steps either run already has."""

    tracker: Tracker
    path: Path
    stage_run_id: str
    parent_run_id: str
    step_offset: int
    events_path: Path | None = None  # checkpoint events become tags naming the checkpoint
    offset: int = 0
    events_offset: int = 0
    last_step: int = field(init=False)
    last_parent_step: int = field(init=False)

    def __post_init__(self) -> None:
        self.last_step = self.tracker.max_step(self.stage_run_id)
        self.last_parent_step = self.tracker.max_step(self.parent_run_id)

    def pump(self) -> int:
        """Forward new complete records; returns how many steps were logged."""
        records, self.offset = read_new_lines(self.path, self.offset)
        stage, parent = [], []
        for r in records:
            ts = int(r["time"] * 1000)
            if r["step"] > self.last_step:
                stage += [Metric(k, float(r[k]), ts, r["step"]) for k in METRIC_KEYS if k in r]
                self.last_step = r["step"]
            global_step = self.step_offset + r["step"]
            if global_step > self.last_parent_step:
                parent += [Metric(k, float(r[k]), ts, global_step) for k in ("loss", "lr") if k in r]
                self.last_parent_step = global_step
        if stage:
            self.tracker.log_metrics(self.stage_run_id, stage)
        if parent:
            self.tracker.log_metrics(self.parent_run_id, parent)
        if self.events_path is not None:
            events, self.events_offset = read_new_lines(self.events_path, self.events_offset)
            ckpts = {f"checkpoint.{e['step']:08d}": e["path"] for e in events if e["event"] == "checkpoint"}
            if ckpts:
                self.tracker.set_tags(self.stage_run_id, {**ckpts, "checkpoint.latest": list(ckpts.values())[-1]})
        return len(stage)
