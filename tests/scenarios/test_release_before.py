"""A campaign written by the previous release resumes with this one: its ledger (version 1),
checkpoints, data set, job records and MLflow store, as that release left them."""

from __future__ import annotations

import json
import sqlite3
import tarfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.campaign import pretrain_campaign
from pretrain.spec.file import load_spec
from support.campaigns import assert_no_duplicate_metric_steps

# `pretrain run spec.yaml` on main 6b4a8a5 (the last commit before the typed ledger, events and
# records of issue 11), stopped with SIGTERM once the second stage had a checkpoint: warmup
# completed, main interrupted at step 32 of 200 (not yet judged). The archive holds the workdir
# as that run left it (its lock file included) and the spec; absolute paths in it start with
# OLD_ROOT and are moved to the test's directory on restore.
ARCHIVE = Path(__file__).parents[1] / "data" / "campaign_release_before.tar.gz"
OLD_ROOT = "/tmp/oldrel"


def restore(tmp_path: Path) -> Path:
    """The archived campaign under ``tmp_path`` (paths rewritten); returns the spec file."""
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".yaml", ".lock", "") and path.name != "mlflow.db":
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            if OLD_ROOT in text:
                path.write_text(text.replace(OLD_ROOT, str(tmp_path)))
    with sqlite3.connect(tmp_path / "w" / "mlflow.db") as db:
        for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri")):
            db.execute(f"UPDATE {table} SET {column} = replace({column}, ?, ?)", (OLD_ROOT, str(tmp_path)))
    return tmp_path / "spec.yaml"


@pytest.fixture
def before(tmp_path):
    spec = load_spec(restore(tmp_path))
    ledger = json.loads((spec.workdir_path / "ledger.json").read_text())
    assert "version" not in ledger and ledger["stages"]["main"]["status"] == "interrupted"  # as that release wrote it
    return spec, ledger


def test_a_campaign_of_the_previous_release_resumes_where_it_stopped(prefect_harness, before):
    spec, old = before

    status = pretrain_campaign(spec=spec)

    assert status["status"] == "completed"
    warmup, main = status["stages"]
    assert warmup["attempts"] == 1 and warmup["good_checkpoint"]["step"] == 6  # done before: not trained again
    assert main["steps_done"] == 200 and main["good_checkpoint"]["step"] == 200
    resumed = [r for r in main["resumes"] if r["attempt"] == 1]
    assert resumed and resumed[0]["source"] == "checkpoint" and resumed[0]["checkpoint"].endswith("main/step_00000032")

    client = MlflowClient(spec.tracking_uri)  # the same MLflow runs carry on
    assert status["mlflow"]["parent_run_id"] == old["mlflow"]["parent_run_id"]
    stage_run = client.get_run(old["stages"]["main"]["mlflow_run_id"])
    steps = [m.step for m in client.get_metric_history(stage_run.info.run_id, "loss")]
    assert min(steps) <= 32 and max(steps) == 200  # logged before the stop and after it, in the one stage run
    assert_no_duplicate_metric_steps(spec.tracking_uri)
    assert status["data"]["fingerprint"] == old["data"]["fingerprint"]  # its data set, not a new one
