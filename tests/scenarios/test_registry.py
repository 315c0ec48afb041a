"""The MLflow model registry (real sqlite backend): a checkpoint registered as a transformers
model of a run, with its metrics and an alias, loads by ``models:/<name>@<alias>`` and predicts
what our model predicts; registering it again changes nothing."""

from __future__ import annotations

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from test_export import greedy, our_model
from tokenizers import Tokenizer

from pretrain.checkpoints.info import describe
from pretrain.checkpoints.registry import TAG_CHECKPOINT, register_checkpoint
from pretrain.tracking.runs import Tracker
from support.campaigns import assert_no_duplicate_metric_steps, campaign_data_dir
from tasks.registry import retry_delays
from trainer.data.sampler import TokenWindows


def test_registered_model_loads_by_alias_and_predicts_like_our_model(
    trained_checkpoint, tmp_path, monkeypatch, own_tracking_store
):
    spec, ref = trained_checkpoint
    uri = own_tracking_store
    run_id = Tracker(uri, "registry", tmp_path / "artifacts").campaign_run("c1", "t", "hash", {})
    info = describe(ref.location)
    reg = register_checkpoint(
        info,
        tracking_uri=uri,
        run_id=run_id,
        name="tiny-gpt",
        alias="latest-good",
        metrics={"val_loss": 5.5, "val_accuracy": 0.1},
        step=16,
    )
    assert reg.uri == "models:/tiny-gpt@latest-good" and not reg.reused

    client = MlflowClient(uri, uri)
    version = client.get_model_version_by_alias("tiny-gpt", "latest-good")
    assert str(version.version) == reg.version and version.run_id == run_id
    assert version.tags[TAG_CHECKPOINT] == ref.location and version.tags["val_loss"] == "5.5"
    logged = client.get_logged_model(reg.model_id)
    assert logged.source_run_id == run_id and logged.status == "READY"
    assert {(m.key, m.step, m.value) for m in logged.metrics} == {("val_loss", 16, 5.5), ("val_accuracy", 16, 0.1)}

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # how a user points MLflow at the server
    parts = mlflow.transformers.load_model(reg.uri, return_type="components")
    ours = our_model(ref.location)
    x = torch.stack([TokenWindows(campaign_data_dir(spec), "val", 32)[i] for i in range(2)])
    with torch.no_grad():
        assert (parts["model"](x).logits - ours(x)).abs().max().item() < 1e-5

    prompt = "def dumps(obj"
    tok = Tokenizer.from_file(str(campaign_data_dir(spec) / "tokenizer.json"))
    expected = tok.decode(greedy(ours, torch.tensor([tok.encode(prompt).ids]), 5)[0].tolist())
    predicted = mlflow.pyfunc.load_model(reg.uri).predict([prompt], params={"max_new_tokens": 5})
    assert predicted == [expected]

    again = register_checkpoint(
        info, tracking_uri=uri, run_id=run_id, name="tiny-gpt", alias="latest-good", metrics={"val_loss": 5.5}, step=16
    )
    assert again.reused and again.version == reg.version
    assert len(client.search_model_versions("name = 'tiny-gpt'")) == 1


def test_registering_links_the_final_evaluation_without_logging_it_twice(
    trained_checkpoint, tmp_path, own_tracking_store
):
    spec, ref = trained_checkpoint
    uri = own_tracking_store
    tracker = Tracker(uri, "registry", tmp_path / "artifacts")
    run_id = tracker.campaign_run("c1", "t", "hash", {})
    evaluation = {"val_loss": 5.5, "val_accuracy": 0.1}
    tracker.log_values(run_id, evaluation, 16)  # the campaign's final evaluation, as the evaluate flow logs it
    tracker.log_values(run_id, evaluation, 16)  # ... and again after a resume: held already, not logged
    reg = register_checkpoint(
        describe(ref.location),
        tracking_uri=uri,
        run_id=run_id,
        name="tiny-gpt",
        alias="latest-good",
        metrics={**evaluation, "val_tokens": 512.0},
        step=16,
    )
    client = MlflowClient(uri, uri)
    for key in ("val_loss", "val_accuracy", "val_tokens"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [16]
    logged = client.get_logged_model(reg.model_id)
    assert {(m.key, m.step, m.value) for m in logged.metrics} == {
        ("val_loss", 16, 5.5),
        ("val_accuracy", 16, 0.1),
        ("val_tokens", 16, 512.0),
    }
    assert_no_duplicate_metric_steps(uri)


@pytest.mark.parametrize("alias", ["latest", "v3", "has space"])
def test_reserved_or_invalid_alias_is_refused_by_the_spec(alias):
    from pretrain.spec.campaign import SpecError, parse_spec

    with pytest.raises(SpecError, match="tracking.model_alias"):
        parse_spec({"tracking": {"model_alias": alias}})


@pytest.mark.parametrize(
    "wait_s, delays",
    [
        (0, []),
        (1.9, []),
        (2, [2]),
        (11, [2]),
        (12, [2, 10]),
        (101, [2, 10, 30]),
        (102, [2, 10, 30, 60]),
        (600, [2, 10, 30, 60]),
    ],
)
def test_the_registration_retries_while_mlflow_is_away_for_as_long_as_the_spec_allows(wait_s, delays):
    """``tracking.registration_wait_s``: the tries that fit; past them the campaign completes with
    the registration pending (tests/scenarios/test_mlflow_away.py)."""
    assert retry_delays(wait_s) == delays
