"""The prepared data set as an MLflow dataset input of the campaign's run: which data (name,
fingerprint as digest, where it lives) and what is in it (documents, tokens, skips as profile),
so a run says what it trained on and two runs on the same data set show the same digest."""

from __future__ import annotations

import json

from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

DIGEST_MAX = 36  # MLflow's dataset digest column


def data_set_profile(summary: dict) -> dict:
    """The stats worth seeing next to the run, from a data set's manifest (v1 or v2; absent keys skipped)."""
    profile = {
        k: summary[k]
        for k in ("documents", "tokens", "vocab_size", "dtype", "skipped", "groups", "tokenizer_sha256")
        if k in summary
    }
    sources = summary.get("sources")
    if isinstance(sources, list):
        profile["sources"] = len(sources)
    return profile


def data_set_entity(name: str, summary: dict) -> Dataset:
    """``summary``: the manifest prepare() returned (its ``location`` and ``fingerprint``)."""
    location = str(summary.get("location") or summary.get("data_dir") or "")
    return Dataset(
        name=name,
        digest=str(summary.get("fingerprint") or "unknown")[:DIGEST_MAX],
        source_type="s3" if location.startswith("s3://") else "local",
        source=json.dumps({"uri": location}),
        schema=json.dumps(
            {"dtype": summary.get("dtype"), "vocab_size": summary.get("vocab_size"), "eot_id": summary.get("eot_id")}
        ),
        profile=json.dumps(data_set_profile(summary), sort_keys=True),
    )


def log_data_set(client: MlflowClient, run_id: str, name: str, summary: dict) -> None:
    """Log the data set as the run's training input; idempotent (MLflow keeps one input per
    run and data set name + digest), so a retried task or a resumed campaign logs it once."""
    client.log_inputs(
        run_id,
        datasets=[DatasetInput(data_set_entity(name, summary), tags=[InputTag(MLFLOW_DATASET_CONTEXT, "train")])],
    )
