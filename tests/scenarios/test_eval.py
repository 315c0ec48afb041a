"""`pretrain eval` and the evaluate-checkpoint flow need only a checkpoint's location: a good
checkpoint is measured (and logged to MLflow at its step), a bad one refused naming why."""

from __future__ import annotations

import json
import math
import uuid

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.evaluate_checkpoint import evaluate_checkpoint
from pretrain.checkpoints.info import CheckpointInfoError, CheckpointRejected, describe
from pretrain.run.jobs import model_config
from support import s3_servers
from support.campaigns import (
    campaign_data_dir,
    copy_checkpoint,
    flip_byte,
    pretrain_cli,
    save_checkpoint,
    seed_data,
    small_spec,
)
from support.s3_servers import BUCKET
from tasks.evaluation import evaluate_stage_checkpoint
from trainer.checkpoint.store import MANIFEST
from trainer.evaluate import evaluate

seaweed = s3_servers.seaweed
aws_env = s3_servers.aws_env


def corrupt(step_dir):
    flip_byte(step_dir / "model.pt")


def strip_record(step_dir):
    """Make the manifest look like one written before checkpoints described themselves."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for key in ("model", "data_dir", "seq_len"):
        del manifest[key]
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def mlflow_run(tmp_path, uri: str) -> tuple[str, MlflowClient, str]:
    client = MlflowClient(uri)
    return uri, client, client.create_run(client.create_experiment("eval", (tmp_path / "art").as_uri())).info.run_id


def test_eval_prints_the_metrics_of_a_good_checkpoint(trained_checkpoint, tmp_path, own_tracking_store):
    spec, ref = trained_checkpoint
    uri, client, run_id = mlflow_run(tmp_path, own_tracking_store)
    proc = pretrain_cli("eval", ref.location, "--json", "--tracking-uri", uri, "--run-id", run_id)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert client.get_run(run_id).data.metrics["val_loss"] == pytest.approx(out["val_loss"])
    data_dir = campaign_data_dir(spec)
    expected = evaluate(
        ref.location,
        model_config(spec, 512),
        data_dir,
        spec.stages[0].seq_len,
        max_batches=spec.validation.eval_batches,
    )
    assert out["checkpoint"] == ref.location and out["step"] == ref.step == 2
    for key in ("val_loss", "val_accuracy", "val_tokens"):
        assert out[key] == pytest.approx(expected[key])
    assert out["val_perplexity"] == pytest.approx(math.exp(out["val_loss"]))


def test_eval_refuses_a_corrupted_checkpoint_naming_the_reason(trained_checkpoint, tmp_path):
    location = copy_checkpoint(trained_checkpoint[1], tmp_path, corrupt)
    proc = pretrain_cli("eval", location)
    assert proc.returncode == 1
    assert "step_00000002/model.pt: sha256 does not match the manifest" in proc.stderr
    assert "val_loss" not in proc.stdout


def test_an_old_checkpoint_without_its_record_names_the_option_to_pass(trained_checkpoint, tmp_path):
    spec, ref = trained_checkpoint
    location = copy_checkpoint(ref, tmp_path, strip_record)
    with pytest.raises(CheckpointInfoError, match="does not record its model configuration.*pass --spec"):
        describe(location)
    with pytest.raises(CheckpointInfoError, match="does not record its data directory.*pass --data-dir"):
        describe(location, model=model_config(spec, 512))
    with pytest.raises(CheckpointInfoError, match="holds no prepared data set.*pass --data-dir"):
        describe(ref.location, data_dir=tmp_path)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    proc = pretrain_cli("eval", location, "--spec", str(spec_file))
    assert proc.returncode == 0, proc.stderr
    assert "val_loss" in proc.stdout and "(step 2): valid" in proc.stdout


def test_flow_logs_the_metrics_to_mlflow_at_the_checkpoint_step(
    prefect_harness, trained_checkpoint, tmp_path, own_tracking_store
):
    _, ref = trained_checkpoint
    uri, client, run_id = mlflow_run(tmp_path, own_tracking_store)
    result = evaluate_checkpoint(checkpoint=ref.location, tracking_uri=uri, run_id=run_id)
    assert result["step"] == 2 and result["val_loss"] > 0
    for key in ("val_loss", "val_perplexity", "val_accuracy"):
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, key)] == [(2, pytest.approx(result[key]))]

    bad = copy_checkpoint(ref, tmp_path, corrupt)
    with pytest.raises(CheckpointRejected, match="sha256 does not match"):
        evaluate_checkpoint(checkpoint=bad, tracking_uri=uri, run_id=run_id)
    assert len(client.get_metric_history(run_id, "val_loss")) == 1  # nothing logged for the bad one


def test_eval_of_a_checkpoint_on_s3(prepared_data, tmp_path, seaweed, aws_env):
    spec = small_spec(
        tmp_path,
        checkpoint={
            "uri": f"s3://{BUCKET}/eval/{uuid.uuid4().hex[:8]}",
            "s3_endpoint_url": seaweed.endpoint,
            "interval": 4,
            "memory_interval": 2,
        },
    )
    seed_data(spec, prepared_data)
    ref = save_checkpoint(spec)
    assert ref.location.startswith("s3://")
    proc = pretrain_cli("eval", ref.location, "--s3-endpoint-url", seaweed.endpoint)
    assert proc.returncode == 0, proc.stderr
    assert "(step 2): valid" in proc.stdout and "val_perplexity" in proc.stdout


def test_the_stage_evaluation_scores_validation_eval_batches(prefect_harness, trained_checkpoint):
    """The evaluation of a stage's final checkpoint scores ``validation.eval_batches`` batches
    of 8 sequences (the spec's setting, not a default of its own)."""
    spec, ref = trained_checkpoint
    seq_len = spec.stages[0].seq_len
    scored = {}
    for batches in (1, 2):
        v = spec.validation.model_copy(update={"eval_batches": batches})
        scored[batches] = evaluate_stage_checkpoint(spec.model_copy(update={"validation": v}), ref.location, seq_len)[
            "val_tokens"
        ]
    assert scored == {1: 8 * seq_len, 2: 2 * 8 * seq_len}
