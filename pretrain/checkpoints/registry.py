"""Register a checkpoint in the MLflow model registry as a ``transformers`` text-generation model.

The checkpoint is exported (``pretrain.checkpoints.export``, Hugging Face GPT-2 layout), saved with the
``mlflow.transformers`` flavor, logged as a model of the given run (its source run) with the
eval metrics linked to it, registered as a new version of ``name`` and pointed to by ``alias``::

    mlflow.transformers.load_model("models:/<name>@<alias>")   # a transformers pipeline
    mlflow.pyfunc.load_model("models:/<name>@<alias>").predict(["def main("])  # text → text

Uses ``MlflowClient`` with explicit URIs (no fluent global state). Idempotent: if a version of
``name`` already holds this checkpoint from this run, the alias is moved to it and nothing is
logged again. Needs ``transformers`` (the ``hf`` extra).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pretrain.checkpoints.export import export_model
from pretrain.checkpoints.info import CheckpointInfo
from pretrain.log_levels import loggers_at
from pretrain.tracking.runs import flatten, logged_at

TAG_CHECKPOINT = "pretrain.checkpoint"
TAG_STEP = "pretrain.step"


@dataclass(frozen=True)
class Registered:
    name: str
    version: str
    alias: str
    model_id: str | None
    checkpoint: str
    reused: bool  # an existing version was found for this checkpoint and run

    @property
    def uri(self) -> str:
        return f"models:/{self.name}@{self.alias}"

    def to_dict(self) -> dict:
        return {**asdict(self), "uri": self.uri}


def _existing(client: MlflowClient, name: str, run_id: str, checkpoint: str):
    versions = client.search_model_versions(f"name = '{name}'")
    return next((v for v in versions if v.run_id == run_id and v.tags.get(TAG_CHECKPOINT) == checkpoint), None)


# loggers that report, at WARNING, what a campaign's user can do nothing about while a model is
# saved: a model card and license "from the hub" (ours is not from the hub), requirements guessed
QUIET_LOGGERS = ("mlflow.transformers", "mlflow.models", "mlflow.utils.requirements_utils", "transformers")


@contextmanager
def quiet_model_saving() -> Iterator[None]:
    """For the duration of the block: transformers' weight-loading progress bars off, and the
    ``QUIET_LOGGERS`` at ERROR; both put back as they were (errors still show)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with loggers_at(logging.ERROR, QUIET_LOGGERS):
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def save_mlflow_model(hf_dir: Path, path: Path, max_seq_len: int) -> None:
    """Save the Hugging Face directory as an ``mlflow.transformers`` text-generation model."""
    import mlflow.transformers
    import tokenizers
    import torch
    import transformers
    from mlflow.models import infer_signature

    pipe = transformers.pipeline("text-generation", model=str(hf_dir), tokenizer=str(hf_dir), device="cpu")
    defaults = {"max_new_tokens": max(1, min(32, max_seq_len // 4)), "do_sample": False}
    reqs = [
        f"torch=={torch.__version__.split('+')[0]}",
        f"transformers=={transformers.__version__}",
        f"tokenizers=={tokenizers.__version__}",
        "safetensors",
    ]  # explicit: MLflow's guess wants torchvision
    mlflow.transformers.save_model(
        pipe,
        str(path),
        signature=infer_signature("text", "text", params=defaults),
        model_config=defaults,
        pip_requirements=reqs,
    )


def link_metrics(client: MlflowClient, run_id: str, model_id: str, metrics: dict[str, float], step: int) -> None:
    """Attach ``metrics`` at ``step`` to the logged model. A metric the run already holds at that
    step (the campaign's final evaluation) is linked as it is — same value and timestamp, which
    MLflow stores once in the run — so the run never gets a second value at one step."""
    held = logged_at(client, run_id, metrics, step)
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[
            Metric(k, held[k].value, held[k].timestamp, step, model_id=model_id)
            if k in held
            else Metric(k, float(v), now, step, model_id=model_id)
            for k, v in metrics.items()
        ],
    )


def register_checkpoint(
    info: CheckpointInfo,
    *,
    tracking_uri: str,
    run_id: str,
    name: str,
    alias: str,
    metrics: dict[str, float],
    step: int | None = None,
    tags: dict[str, str] | None = None,
) -> Registered:
    """Export, log to ``run_id`` (metrics at ``step``, default the checkpoint's), register as
    ``name`` and set ``alias`` on the new version."""
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    version = _existing(client, name, run_id, info.location)
    if version is not None:
        client.set_registered_model_alias(name, alias, version.version)
        return Registered(name, str(version.version), alias, version.model_id, info.location, True)
    run = client.get_run(run_id)
    model_tags = {TAG_CHECKPOINT: info.location, TAG_STEP: str(info.step), **(tags or {})}
    with tempfile.TemporaryDirectory(prefix="pretrain-register-") as tmp:
        hf_dir = export_model(info, Path(tmp) / "hf")
        with quiet_model_saving():
            save_mlflow_model(hf_dir, Path(tmp) / "mlflow-model", info.model.max_seq_len)
        logged = client.create_logged_model(
            run.info.experiment_id,
            name="model",
            source_run_id=run_id,
            tags=model_tags,
            params=flatten(asdict(info.model), "model."),
            model_type="transformers",
        )
        try:
            client.log_model_artifacts(logged.model_id, str(Path(tmp) / "mlflow-model"))
        except BaseException:
            client.finalize_logged_model(logged.model_id, "FAILED")
            raise
        client.finalize_logged_model(logged.model_id, "READY")
    link_metrics(client, run_id, logged.model_id, metrics, info.step if step is None else step)
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="GPT checkpoints registered by prefect-pretrain campaigns.")
    summary = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())
    # source: the logged model's artifact location (a models:/ source would make the sqlite
    # registry resolve it through MLflow's *global* tracking URI)
    version = client.create_model_version(
        name,
        source=logged.artifact_location,
        run_id=run_id,
        model_id=logged.model_id,
        tags={**model_tags, **{k: f"{v:.6g}" for k, v in metrics.items()}},
        description=f"step {info.step} of {info.location}" + (f": {summary}" if summary else ""),
    )
    client.set_registered_model_alias(name, alias, version.version)
    return Registered(name, str(version.version), alias, logged.model_id, info.location, False)
