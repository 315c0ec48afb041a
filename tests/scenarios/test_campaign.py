"""A small campaign end to end through the real flows, processes, checkpoints and MLflow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from flows.campaign import pretrain_campaign
from pretrain.checkpoints.registry import TAG_CHECKPOINT
from pretrain.state.ledger import CampaignMismatch
from pretrain.tracking.runs import TAG_CAMPAIGN_ID, TAG_ROLE, TAG_STAGE
from support.campaigns import (
    assert_no_duplicate_metric_steps,
    campaign_data_dir,
    seed_data,
    small_spec,
    worker_processes,
)
from trainer.checkpoint import store as ckpt


def mlflow_runs(spec):
    client = MlflowClient(spec.tracking_uri)
    exp = client.get_experiment_by_name(spec.tracking.experiment)
    return client, client.search_runs([exp.experiment_id])


@pytest.fixture(scope="module")
def finished(prefect_harness, prepared_data, tmp_path_factory):
    spec = small_spec(tmp_path_factory.mktemp("campaign"), tracking={})  # the defaults: registers the final model
    seed_data(spec, prepared_data)
    return spec, pretrain_campaign(spec=spec)


def test_campaign_completes_every_stage(finished):
    spec, status = finished
    assert status["status"] == "completed"
    for stage, s in zip(spec.stages, status["stages"]):
        assert s["name"] == stage.name and s["status"] == "completed"
        assert s["steps_done"] == stage.steps == s["good_checkpoint"]["step"]
        assert s["attempts"] == 1 and s["restarts"] == 0 and s["failures"] == []
        assert s["eval"]["val_loss"] > 0 and s["eval"]["val_accuracy"] >= 0
    assert not worker_processes(spec.workdir_path)


def test_retention_keeps_at_most_k_checkpoints_ending_at_the_last_step(finished):
    spec, _ = finished
    d = spec.workdir_path / "checkpoints" / "main"
    steps = ckpt.CheckpointStore.open(
        d
    ).committed_steps()  # the saver persists the newest due snapshot: 4 or 8 may be passed over
    assert steps[0] == 10 and len(steps) <= 2 and all(s % 4 == 0 for s in steps[1:])
    assert sorted(int(p.name[5:]) for p in d.glob("step_*")) == sorted(steps)


def test_second_stage_starts_from_the_first_stages_checkpoint(finished):
    spec, status = finished
    start = [r for r in status["stages"][1]["resumes"] if r["source"] == "init_from"]
    assert start and start[0]["checkpoint"].endswith("warmup/step_00000006")


def test_mlflow_has_one_parent_run_with_nested_stage_runs(finished):
    spec, status = finished
    client, runs = mlflow_runs(spec)
    parents = [r for r in runs if r.data.tags[TAG_ROLE] == "campaign"]
    stages = [r for r in runs if r.data.tags[TAG_ROLE] == "stage"]
    assert len(parents) == 1 and len(stages) == 2
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["pretrain.spec_hash"] == spec.spec_hash()
    assert parent.data.params["model.d_model"] == "32"
    for run in stages:
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags[TAG_CAMPAIGN_ID] == parent.data.tags[TAG_CAMPAIGN_ID]
        assert run.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
        n = next(s.steps for s in spec.stages if s.name == run.data.tags[TAG_STAGE])
        assert sorted(steps) == list(range(1, n + 1))
        assert "val_loss" in run.data.metrics
        assert run.data.tags["checkpoint.latest"].endswith(f"step_{n:08d}")
        assert run.data.tags[f"checkpoint.{n:08d}"] == run.data.tags["checkpoint.latest"]
        assert run.data.tags[f"verdict.{n:08d}"] == "good"
    campaign_steps = [m.step for m in client.get_metric_history(parent.info.run_id, "loss")]
    assert sorted(campaign_steps) == list(range(1, sum(s.steps for s in spec.stages) + 1))
    assert_no_duplicate_metric_steps(
        spec.tracking_uri
    )  # val_* at the final step: once from the evaluation, not again from registration


def test_final_good_checkpoint_is_registered_and_checkpoints_describe_themselves(finished):
    spec, status = finished
    final = status["stages"][-1]["good_checkpoint"]["path"]
    store, step = ckpt.CheckpointStore.of_step(final)
    manifest = store.manifest(step).meta
    assert manifest["persisted_by"] == "saver" and manifest["stage"] == "main" and manifest["seq_len"] == 64
    assert manifest["model"]["d_model"] == 32 and manifest["data_dir"] == str(campaign_data_dir(spec))
    client = MlflowClient(spec.tracking_uri, spec.tracking_uri)
    version = client.get_model_version_by_alias(spec.name, "latest-good")
    assert version.run_id == status["mlflow"]["parent_run_id"] and version.tags[TAG_CHECKPOINT] == final
    assert float(version.tags["val_loss"]) == pytest.approx(status["stages"][-1]["eval"]["val_loss"], rel=1e-5)
    assert status["registered_model"]["uri"] == f"models:/{spec.name}@latest-good"
    assert status["goodput"]["parts_s"]["registration"] > 0  # the export and registration's time, not "idle"


def test_rerunning_a_finished_campaign_trains_nothing(finished, prefect_harness):
    spec, before = finished
    again = pretrain_campaign(spec=spec)
    assert [s["attempts"] for s in again["stages"]] == [s["attempts"] for s in before["stages"]]
    assert again["invocations"] == 2 and again["status"] == "completed"
    _, runs = mlflow_runs(spec)
    assert len(runs) == 3
    assert_no_duplicate_metric_steps(spec.tracking_uri)


def test_a_different_spec_refuses_the_workdir(finished, prefect_harness):
    spec, _ = finished
    other = spec.model_copy(update={"seed": spec.seed + 1})
    with pytest.raises(CampaignMismatch, match="--workdir"):
        pretrain_campaign(spec=other)


def test_status_cli_json_matches(finished):
    spec, status = finished
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", "status", "--workdir", str(spec.workdir_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["status"] == "completed"
    assert [(s["name"], s["steps_done"], s["mlflow_run_id"]) for s in shown["stages"]] == [
        (s["name"], s["steps_done"], s["mlflow_run_id"]) for s in status["stages"]
    ]
    assert shown["mlflow"]["ui_command"] == f"mlflow ui --backend-store-uri {spec.tracking_uri}"
    for split in [shown["goodput"], *(s["goodput"] for s in shown["stages"])]:  # fault-free stages: goodput > 0
        assert split["known"] and 0 < split["goodput"] < 1 and split["parts_s"]["productive"] > 0
    table = subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", "status", "--workdir", str(spec.workdir_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "completed" in table.stdout and "mlflow ui" in table.stdout
    assert "goodput: where the wall time went" in table.stdout and "checkpoint blocking" in table.stdout
