"""Multi-stage campaigns: each stage starts from the previous stage's final good checkpoint and
may change sequence length, batch shape, data mixture and whether optimizer state carries over."""

from __future__ import annotations

import json

import pytest

from flows.campaign import pretrain_campaign
from pretrain.run.jobs import checkpoint_store
from support.campaigns import assert_no_duplicate_metric_steps, small_spec

DATA = {
    "sources": {"json": ["{stdlib}/json/*.py"], "email": ["{stdlib}/email/*.py"]},
    "max_bytes": 60_000,
    "tokenizer": {"vocab_size": 300},
    "val_fraction": 0.2,
}
STAGES = [
    {"name": "warmup", "steps": 4, "seq_len": 32, "micro_batch": 4, "warmup_steps": 2, "mixture": {"json": 1}},
    {
        "name": "main",
        "steps": 4,
        "seq_len": 64,
        "micro_batch": 4,
        "mixture": {"json": 3, "email": 1},
        "carry_optimizer": False,
    },
    {
        "name": "anneal",
        "steps": 4,
        "seq_len": 64,
        "micro_batch": 2,
        "grad_accum": 2,
        "lr": 1e-3,
        "min_lr": 1e-5,
        "warmup_steps": 0,
        "mixture": {"json": 1, "email": 1},
    },
]


def optimizer_steps(spec, stage: str) -> float:
    store = checkpoint_store(spec, stage)
    opt = store.load_shard(store.read_pointer(), "model.pt")["optimizer"]
    return float(next(iter(opt["state"].values()))["step"])


@pytest.fixture(scope="module")
def three_stages(prefect_harness, tmp_path_factory):
    spec = small_spec(
        tmp_path_factory.mktemp("stages"),
        data=DATA,
        stages=STAGES,
        checkpoint={"interval": 4, "memory_interval": 2, "keep": 2},
    )
    return spec, pretrain_campaign(spec=spec)


def test_each_stage_starts_from_the_previous_stages_final_good_checkpoint(three_stages):
    spec, status = three_stages
    assert status["status"] == "completed"
    assert_no_duplicate_metric_steps(spec.tracking_uri)
    stages = status["stages"]
    for prev, cur in zip(stages, stages[1:]):
        start = [r for r in cur["resumes"] if r["source"] == "init_from"]
        assert start and start[0]["checkpoint"] == prev["good_checkpoint"]["path"]
        assert prev["good_checkpoint"]["step"] == prev["steps_total"]


def test_optimizer_state_is_reset_or_carried_as_the_stage_says(three_stages):
    spec, _ = three_stages
    assert optimizer_steps(spec, "warmup") == 4
    assert optimizer_steps(spec, "main") == 4  # carry_optimizer: false → fresh AdamW moments
    assert optimizer_steps(spec, "anneal") == 8  # carried over from main


def test_stage_settings_reach_the_workers(three_stages):
    spec, _ = three_stages
    jobs = {
        s["name"]: json.loads((spec.workdir_path / "jobs" / s["name"] / "attempt_000" / "job.json").read_text())
        for s in STAGES
    }
    main, anneal = jobs["main"]["stage"], jobs["anneal"]["stage"]
    assert main["mixture"] == {"json": 3, "email": 1} and main["seq_len"] == 64
    assert (anneal["micro_batch"], anneal["grad_accum"]) == (2, 2)
    assert anneal["global_batch"] == main["global_batch"]
