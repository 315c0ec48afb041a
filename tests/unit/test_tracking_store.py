"""Campaigns share one tracking store by default (MLflow's convention), a campaign keeps the store
its ledger records, the experiment is a model-training one, and tokens seen reach MLflow as a
metric counted over the whole campaign."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pretrain.state.ledger import Ledger
from pretrain.tracking.metrics import MetricsForwarder
from pretrain.tracking.runs import Tracker
from pretrain.tracking.store import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    artifact_root,
    default_tracking_uri,
    recorded_store,
)
from support.campaigns import _tracking_template, small_spec
from trainer.job.reporting import JsonLines


@pytest.mark.parametrize(
    "own_store, env, expected",
    [
        (False, {}, "sqlite:///{cwd}/mlflow.db"),  # MLflow's convention: mlflow.db where campaigns are run from
        (
            False,
            {"MLFLOW_TRACKING_URI": "http://mlflow:5000"},
            "http://mlflow:5000",
        ),  # ... or the server MLflow is told of
        (False, {"MLFLOW_TRACKING_URI": "  "}, "sqlite:///{cwd}/mlflow.db"),
        (
            True,
            {"MLFLOW_TRACKING_URI": "http://mlflow:5000"},
            "sqlite:///{workdir}/mlflow.db",
        ),  # a store of an earlier release stays
    ],
)
def test_the_default_store_is_shared_unless_the_workdir_has_its_own(tmp_path, own_store, env, expected):
    workdir, cwd = tmp_path / "w", tmp_path / "here"
    workdir.mkdir()
    if own_store:
        (workdir / "mlflow.db").touch()
    assert default_tracking_uri(workdir, env, cwd) == expected.format(cwd=cwd, workdir=workdir)


@pytest.mark.parametrize(
    "recorded, used",
    [
        ("sqlite:////runs/mlflow.db", "sqlite:////runs/mlflow.db"),
        ("http://mlflow:5000", "http://mlflow:5000"),
        ("https://***@mlflow.example.com", None),  # recorded with its credentials masked: the environment's is used
        (None, None),
        ("", None),
    ],
)
def test_a_recorded_store_is_used_as_recorded_unless_masked(recorded, used):
    assert recorded_store(recorded) == used


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("sqlite:////shared/mlflow.db", "/shared/mlartifacts"),  # beside a shared store: every campaign finds them
        ("sqlite:////w/mlflow.db", "/w/mlartifacts"),  # the workdir's own store: as before
        ("http://mlflow:5000", "/w/mlartifacts"),
    ],
)
def test_artifacts_go_beside_a_shared_store(uri, expected):
    assert str(artifact_root(uri, Path("/w/mlartifacts"))) == expected


def test_a_campaign_resumed_from_another_directory_uses_the_store_it_started_with(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    spec = small_spec(tmp_path / "w")
    monkeypatch.chdir(first)
    ledger = Ledger.open(spec)  # created here: records this directory's store
    ledger.save()
    assert ledger.record.mlflow.tracking_uri == f"sqlite:///{first}/mlflow.db"
    monkeypatch.chdir(second)
    assert spec.tracking_uri == f"sqlite:///{second}/mlflow.db"  # a new campaign here would share this one
    resumed = spec.with_tracking_uri(Ledger.open(spec).record.mlflow.tracking_uri)  # what the campaign flow does
    assert resumed.tracking_uri == f"sqlite:///{first}/mlflow.db"
    assert resumed.spec_hash() == spec.spec_hash()  # where it is tracked is not what it is
    named = small_spec(tmp_path / "w", tracking={"uri": "http://mlflow:5000", "register_model": False})
    assert (
        named.with_tracking_uri(ledger.record.mlflow.tracking_uri).tracking_uri == "http://mlflow:5000"
    )  # the spec's wins


@pytest.fixture
def store(prepared_data, tmp_path):
    """A migrated, empty sqlite store (the session's template) in this test's directory."""
    path = tmp_path / "shared" / "mlflow.db"
    path.parent.mkdir()
    shutil.copyfile(_tracking_template(prepared_data), path)
    return f"sqlite:///{path}"


def test_the_experiment_is_a_model_training_one_new_or_existing(store, tmp_path):
    client = MlflowClient(store)
    old = client.create_experiment("made-before", artifact_location=(tmp_path / "a").as_uri())
    for name in ("pretrain", "made-before"):
        tracker = Tracker(store, name, tmp_path / "w" / "mlartifacts")
        assert client.get_experiment(tracker.experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert Tracker(store, "made-before", tmp_path).experiment_id == old


def test_tokens_seen_count_over_the_whole_campaign(store, tmp_path):
    """The stage run counts its own tokens; the campaign run goes on from the stages before (read
    back from MLflow), so curves over stages can be drawn against tokens."""
    tracker = Tracker(store, "pretrain", tmp_path / "w" / "mlartifacts")
    parent = tracker.campaign_run("c1", "t", "h", {})
    tracker.log_values(parent, {"tokens_seen": 1024.0}, 4)  # the first stage: 4 steps of 256 tokens
    stage = tracker.stage_run("c1", parent, "t", "main", {})
    path = tmp_path / "metrics.jsonl"
    out = JsonLines(path)
    for step in (1, 2):
        out.write(
            {
                "step": step,
                "time": 100.0 + step,
                "loss": 3.0,
                "lr": 1e-3,
                "tokens": 512 * step,
                **({"ckpt_block_s": 0.25} if step == 2 else {}),
            }
        )
    out.close()
    forwarder = MetricsForwarder(tracker, path, stage, parent, step_offset=4, log=lambda _: None)
    assert forwarder.pump(final=True) == 2
    client = MlflowClient(store)
    seen = lambda run: {m.step: m.value for m in client.get_metric_history(run, "tokens_seen")}  # noqa: E731
    assert seen(stage) == {1: 512, 2: 1024}
    assert seen(parent) == {4: 1024, 5: 1536, 6: 2048}
    assert [m.value for m in client.get_metric_history(stage, "checkpoint_block_s")] == [0.25]


def test_every_key_a_campaign_logs_is_documented():
    """docs/tracking.md is the reference for dashboards and comparisons: every metric and tag key
    the code logs is in it."""
    from pretrain.tracking import runs as tracking
    from pretrain.views.compare import COUNTERS

    doc = (Path(__file__).parents[2] / "docs" / "tracking.md").read_text()
    tags = [v for k, v in vars(tracking).items() if k.startswith("TAG_")]
    keys = [*tracking.STAGE_METRICS, *tracking.CAMPAIGN_METRICS, *COUNTERS, *tags, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND]
    assert [k for k in keys if f"`{k}`" not in doc and f"`{k} " not in doc] == []
