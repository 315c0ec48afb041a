"""The validation gate: damaged checkpoints are marked bad, kept for forensics and never
resumed from; the previous good checkpoint is."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from pretrain.checkpoints.gate import gate_request, gate_timeout_s, judge, run_gate
from pretrain.run.jobs import checkpoint_store, model_config
from pretrain.settings import PretrainSettings, SettingsError
from pretrain.state.ledger import Ledger
from support.campaigns import (
    assert_no_duplicate_metric_steps,
    campaign_data_dir,
    flip_byte,
    save_checkpoint,
    seed_data,
    small_spec,
)
from tasks.checkpoints import find_resume_point
from trainer.checkpoint.store import rank_shard_name, step_name
from trainer.data.sampler import TokenWindows, read_manifest
from trainer.evaluate import held_out_loss
from trainer.model import GPT, lm_loss

TIMEOUT = PretrainSettings().gate_timeout_floor_s  # run_gate called directly


def _spec(tmp_path, prepared_data):
    spec = small_spec(tmp_path, stages=[{"name": "s", "steps": 8, "seq_len": 32, "micro_batch": 4}])
    seed_data(spec, prepared_data)
    Ledger.open(spec).save()
    return spec


def write_checkpoint(spec, step: int, *, nan: bool = False, reported_loss: float | None = None) -> None:
    """A real checkpoint of the spec's model after one AdamW step, committed atomically. The
    training loss recorded with it is the model's own held-out loss unless ``reported_loss``."""
    data_dir = campaign_data_dir(spec)
    torch.manual_seed(step)
    model = GPT(model_config(spec, read_manifest(data_dir)["vocab_size"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = torch.stack([TokenWindows(data_dir, "train", 32)[i] for i in range(4)])
    lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
    opt.step()
    if nan:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
    loss = held_out_loss(model, data_dir, 32, 16)["loss"] if reported_loss is None else reported_loss
    store = checkpoint_store(spec, "s")
    shards = [
        store.write_shard(
            step,
            "model.pt",
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": {"step": step}, "step": step},
        ),
        store.write_shard(
            step,
            rank_shard_name(0),
            {"rng_cpu": torch.get_rng_state(), "consumed": 4 * step, "step": step, "rank": 0, "loss": loss},
        ),
    ]
    store.commit(step, shards, {"world_size": 1})


def _flip_byte(store, step):
    flip_byte(store.storage.local_path(f"{step_name(step)}/model.pt"))


def _truncate(store, step):
    p = store.storage.local_path(f"{step_name(step)}/{rank_shard_name(0)}")
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _drop_manifest(store, step):
    store.storage.delete(f"{step_name(step)}/manifest.json")


def _truncate_manifest(store, step):
    p = store.storage.local_path(f"{step_name(step)}/manifest.json")
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _escaping_shard_name(store, step):
    p = store.storage.local_path(f"{step_name(step)}/manifest.json")
    manifest = json.loads(p.read_text())
    manifest["files"]["../../outside.pt"] = manifest["files"].pop("model.pt")
    p.write_text(json.dumps(manifest))


DAMAGE = {
    "flipped byte": (lambda spec: write_checkpoint(spec, 8), _flip_byte, "sha256 does not match"),
    "truncated shard": (lambda spec: write_checkpoint(spec, 8), _truncate, "bytes, manifest says"),
    "missing manifest": (lambda spec: write_checkpoint(spec, 8), _drop_manifest, "no manifest.json"),
    "truncated manifest": (lambda spec: write_checkpoint(spec, 8), _truncate_manifest, "manifest.json is damaged"),
    "shard name escapes": (lambda spec: write_checkpoint(spec, 8), _escaping_shard_name, "'../../outside.pt'"),
    "NaN weights": (lambda spec: write_checkpoint(spec, 8, nan=True), None, "NaN/Inf"),
    "probe out of tolerance": (lambda spec: write_checkpoint(spec, 8, reported_loss=1.0), None, "probe loss"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_bad_kept_and_never_resumed_from(prefect_harness, prepared_data, tmp_path, damage):
    spec = _spec(tmp_path, prepared_data)
    write_checkpoint(spec, 4)
    make, harm, reason = DAMAGE[damage]
    make(spec)
    store = checkpoint_store(spec, "s")
    if harm:
        harm(store, 8)

    point = find_resume_point(spec, 0)

    assert point == {"step": 4, "path": store.ref(4).location}  # the previous good one
    assert store.read_pointer() == 4 and store.latest_good().step == 4
    assert store.latest_complete().step == 4  # what a worker restoring from storage would take
    stage = Ledger.open(spec).stage("s")
    verdicts = {v.step: v for v in stage.verdicts}
    assert verdicts[4].verdict == "good" and verdicts[8].verdict == "bad"
    assert any(reason in p for p in verdicts[8].problems), verdicts[8].problems
    (moved,) = stage.rewinds[0].quarantined  # kept for forensics, out of the way
    kept = store.storage.local_path(moved["path"].rpartition("/checkpoints/s/")[2])
    assert kept.is_dir() and json.loads((kept / "verdict.json").read_text())["verdict"] == "bad"
    assert not (store.storage.local_path(step_name(8))).exists()  # step 8 can be committed again


def test_gate_accepts_a_sound_checkpoint_and_reports_its_probe(prepared_data, tmp_path):
    spec = _spec(tmp_path, prepared_data)
    write_checkpoint(spec, 4)
    (out,) = run_gate([gate_request(spec, 0, checkpoint_store(spec, "s").ref(4).location, evaluate=True)], TIMEOUT)
    assert out["verdict"]["ok"], out["verdict"]["problems"]
    probe = out["verdict"]["metrics"]
    assert probe["probe_loss"] == pytest.approx(probe["train_loss"], rel=1e-4)
    assert out["metrics"]["val_loss"] > 0 and 0 <= out["metrics"]["val_accuracy"] <= 1


def test_no_good_checkpoint_rewinds_to_nothing(prefect_harness, prepared_data, tmp_path):
    spec = _spec(tmp_path, prepared_data)
    write_checkpoint(spec, 4, nan=True)
    assert find_resume_point(spec, 0) is None
    store = checkpoint_store(spec, "s")
    assert store.read_pointer() is None and store.latest_complete() is None


def test_campaign_rewinds_past_a_silently_corrupted_checkpoint(prefect_harness, prepared_data, tmp_path):
    """A byte of the final checkpoint is flipped in storage after it was committed: the gate
    marks it bad, the stage goes back to the previous good checkpoint, trains the last steps
    again and completes; MLflow has the evaluations at the good checkpoints' steps."""
    from mlflow.tracking import MlflowClient

    from flows.campaign import pretrain_campaign

    spec = small_spec(
        tmp_path,
        stages=[{"name": "s", "steps": 8, "seq_len": 32, "micro_batch": 4}],
        checkpoint={"interval": 4, "memory_interval": 2, "keep": 2},
        chaos=[
            {"kind": "corrupt_checkpoint", "step": 8},
            # steps slow enough for the saver to persist step 4 before step 8 is due (from step 2: a
            # slow_worker from step 1 also slows the node check before training, 30× its delay)
            {"kind": "slow_worker", "rank": 0, "step": 2, "delay_s": 0.3},
        ],
    )
    seed_data(spec, prepared_data)
    status = pretrain_campaign(spec=spec)
    assert_no_duplicate_metric_steps(spec.tracking_uri)

    (s,) = status["stages"]
    assert status["status"] == "completed" and s["good_checkpoint"]["step"] == 8 and s["attempts"] == 2
    assert [b["step"] for b in s["bad_checkpoints"]] == [8]
    assert "sha256 does not match" in s["bad_checkpoints"][0]["problems"][0]
    relaunch = [r for r in s["resumes"] if r["attempt"] == 1]
    assert relaunch[0]["source"] == "checkpoint" and relaunch[0]["checkpoint"].endswith("step_00000004")
    store = checkpoint_store(spec, "s")
    assert store.verdict(8)["verdict"] == "good" and store.verify(8) == []
    assert len(store.storage.list("quarantine/")) > 0  # the bad one, kept for forensics

    client = MlflowClient(spec.tracking_uri)
    run = client.get_run(s["mlflow_run_id"])
    assert run.data.tags["verdict.00000008"] == "good" and "sha256" in run.data.tags["verdict.00000008.problems"]
    good_steps = {v.step for v in Ledger.open(spec).stage("s").verdicts if v.verdict == "good"}
    evaluated = {m.step for m in client.get_metric_history(run.info.run_id, "val_loss")}
    assert 8 in evaluated and evaluated <= good_steps


def test_checkpoints_pruned_before_they_are_judged_get_no_verdict(prepared_data, tmp_path):
    """Retention (the saver's ``keep``) may delete checkpoints the gate has listed but not yet
    judged: they are skipped, not judged bad, and nothing of them is written back."""
    spec = _spec(tmp_path, prepared_data)
    store = checkpoint_store(spec, "s")
    for step in (2, 4, 6):
        write_checkpoint(spec, step)
    pending = store.unjudged()
    assert store.prune(keep=1) == [2, 4]

    records = judge(spec, 0, pending)

    assert [(r["step"], r["verdict"]) for r in records] == [(6, "good")]
    assert store.all_steps() == [6] and store.latest_good().step == 6


def test_one_damaged_checkpoint_does_not_stop_the_gate_judging_the_others(prepared_data, tmp_path):
    """The gate judges a batch in one process: a checkpoint whose manifest is damaged is judged
    bad on its own; the good ones around it are judged good."""
    spec = _spec(tmp_path, prepared_data)
    store = checkpoint_store(spec, "s")
    for step in (2, 4, 6):
        write_checkpoint(spec, step)
    _truncate_manifest(store, 4)

    records = judge(spec, 0, [2, 4, 6])

    assert [(r["step"], r["verdict"]) for r in records] == [(2, "good"), (4, "bad"), (6, "good")]
    assert "manifest.json is damaged" in records[1]["problems"][0]
    assert store.verdict(4)["verdict"] == "bad" and store.latest_good().step == 6


def test_a_request_that_cannot_be_judged_now_is_unjudged_not_bad(prepared_data, tmp_path):
    """A failure that is not the checkpoint's (here: the probe's data set is gone) leaves that
    request unjudged, for the next gate pass; the other requests are judged."""
    spec = _spec(tmp_path, prepared_data)
    for step in (2, 4):
        write_checkpoint(spec, step)
    store = checkpoint_store(spec, "s")
    requests = [gate_request(spec, 0, store.ref(step).location, evaluate=False) for step in (2, 4)]
    requests[1]["probe"]["data_dir"] = str(tmp_path / "gone")

    good, later = run_gate(requests, TIMEOUT)

    assert good["verdict"]["ok"] and "unjudged" not in good
    assert "no data manifest" in later["unjudged"] and "verdict" not in later


def test_a_gate_timeout_is_unjudged_and_retried(prepared_data, tmp_path):
    """The gate process running out of time is not a verdict and not a stage failure: nothing is
    written, the checkpoint stays pending and the next pass judges it."""
    spec = _spec(tmp_path, prepared_data)
    write_checkpoint(spec, 4)
    store = checkpoint_store(spec, "s")

    (record,) = judge(spec, 0, [4], timeout_s=0.01)

    assert record["verdict"] == "unjudged" and "timed out" in record["problems"][0]
    assert store.verdict(4) is None and store.unjudged() == [4]
    assert [r["verdict"] for r in judge(spec, 0, store.unjudged())] == ["good"]


def test_the_gate_runs_from_a_script_without_a_main_guard(tmp_path):
    """A campaign started from a script with no ``if __name__ == "__main__"``: the gate runs in a
    fresh interpreter (a process forked by multiprocessing would run the script again), judges,
    and the script's top level runs once. (Under pytest the gate is forked: every other test here.)"""
    spec = small_spec(tmp_path)
    request = {
        "location": str(tmp_path / "ckpt" / step_name(4)),
        "options": {},
        "probe": None,
        "evaluate": None,
        "model": dataclasses.asdict(model_config(spec, 512)),
    }
    script = tmp_path / "campaign.py"
    script.write_text(
        "import json, sys\nfrom pretrain.checkpoints.gate import run_gate\nprint('top level', flush=True)\n"
        "print(json.dumps(run_gate(json.loads(sys.argv[1]), 600)))\n"
    )
    ran = subprocess.run(
        [sys.executable, str(script), json.dumps([request])], capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0 and ran.stdout.count("top level") == 1, ran.stderr[-3000:]
    [out] = json.loads(ran.stdout.splitlines()[-1])
    assert out["verdict"]["ok"] is False and "no manifest.json" in out["verdict"]["problems"][0]


@pytest.mark.parametrize(
    "total_bytes, requests, expected",
    [
        (0, 1, 600),  # small checkpoints: the floor
        (100 * 2**20, 3, 600),
        (10 * 2**30, 1, 60 + 2 * 10 * 2**30 / (20 * 2**20)),  # 10 GiB: hashed and loaded at the minimum rate
        (10 * 2**30, 4, 4 * 60 + 2 * 10 * 2**30 / (20 * 2**20)),
    ],
)
def test_gate_timeout_scales_with_the_bytes_to_verify(total_bytes, requests, expected):
    assert gate_timeout_s(total_bytes, requests, PretrainSettings()) == pytest.approx(expected)


def test_the_gate_timeout_is_set_by_pretrain_environment_variables(prepared_data, tmp_path, monkeypatch):
    """PRETRAIN_GATE_* reach the gate the campaign runs (``judge`` with no timeout of its own):
    a machine whose gate needs less (or more) time says so without touching the spec."""
    spec = _spec(tmp_path, prepared_data)
    write_checkpoint(spec, 4)
    monkeypatch.setenv("PRETRAIN_GATE_TIMEOUT_FLOOR_S", "0.01")
    monkeypatch.setenv("PRETRAIN_GATE_PER_REQUEST_S", "0")
    monkeypatch.setenv("PRETRAIN_GATE_MIN_BYTES_PER_S", "1e15")

    (record,) = judge(spec, 0, [4])

    assert record["verdict"] == "unjudged" and "timed out after 0s" in record["problems"][0]
    monkeypatch.setenv("PRETRAIN_GATE_PER_REQUEST_S", "not a number")
    with pytest.raises(
        SettingsError, match="PRETRAIN_GATE_PER_REQUEST_S='not a number': Input should be a valid number"
    ):
        judge(spec, 0, [4])


def test_campaign_rewinds_past_a_checkpoint_whose_manifest_was_truncated(prefect_harness, prepared_data, tmp_path):
    """A committed checkpoint's manifest is truncated while the campaign is stopped: on resume,
    the gate judges it bad, the stage rewinds to the previous good checkpoint and completes."""
    from flows.campaign import pretrain_campaign

    spec = _spec(tmp_path, prepared_data)
    save_checkpoint(spec, steps=4)
    save_checkpoint(spec, steps=6)
    store = checkpoint_store(spec, "s")
    _truncate_manifest(store, 6)

    status = pretrain_campaign(spec=spec)

    (s,) = status["stages"]
    assert status["status"] == "completed" and s["good_checkpoint"]["step"] == 8
    assert [b["step"] for b in s["bad_checkpoints"]] == [6]
    assert "manifest.json is damaged" in s["bad_checkpoints"][0]["problems"][0]
    assert s["rewinds"][0]["to"] == 4 and s["problems"] == []
