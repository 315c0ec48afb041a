"""A loss anomaly rolled back inside the running worker: no process restart, and the result is
bit for bit the run that never saw the anomalous batch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pretrain.run.incidents import incidents
from pretrain.run.jobs import build_job
from support.campaigns import seed_data, small_spec
from support.jobs import CPU0
from trainer.checkpoint.store import stage_store
from trainer.job.config import JobConfig, drill_from_dict
from trainer.job.reporting import EVENTS, METRICS, read_all
from trainer.loop import train
from trainer.resilience.anomaly import LossAnomaly, SpikeDetector, TooManyRollbacks, read_skips


def direct_job(root: Path, prepared_data: Path, **fields) -> JobConfig:
    """A one-worker job of 12 steps checkpointing straight to storage every 4 steps."""
    spec = small_spec(
        root,
        cluster={"workers_per_node": 1},
        stages=[{"name": "s", "steps": 12, "seq_len": 32, "micro_batch": 2, "warmup_steps": 2}],
        checkpoint={"interval": 4, "memory_interval": 0, "keep": 5},
    )
    seed_data(spec, prepared_data)
    return build_job(spec, 0, 0, None).amended(cluster={"threads_per_worker": 0}, **fields)


def final_model(cfg: JobConfig) -> dict:
    store = stage_store(cfg)
    return store.load_shard(store.read_pointer(), "model.pt")["model"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Both runs on one intra-op thread: with several, a busy machine may have the math library
    use fewer threads in one run than in the other — another order of summation, other bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rolled_back(prepared_data, tmp_path_factory):
    cfg = direct_job(
        tmp_path_factory.mktemp("nan"),
        prepared_data,
        chaos=[drill_from_dict({"kind": "nan_loss", "step": 7, "rank": 0})],
    )
    assert train(cfg, CPU0) == 12
    return cfg


def test_the_worker_rolls_back_in_process_and_records_the_path(rolled_back):
    events = read_all(Path(rolled_back.job_dir) / EVENTS)
    [rollback] = [e for e in events if e["event"] == "rollback"]
    assert rollback["path"] == "in_process" and rollback["pid"] == os.getpid()  # this process, never restarted
    assert (rollback["anomaly_step"], rollback["step"], rollback["source"]) == (7, 4, "checkpoint")
    assert [e["event"] for e in events].count("start") == 1
    [incident] = incidents(events, read_all(Path(rolled_back.job_dir) / METRICS), 0)
    assert incident["cause"] == "nonfinite_loss" and incident["recovery_path"] == "in_process"
    assert incident["action"] == "roll back in process to checkpoint step 4" and incident["steps_redone"] == 2


def test_in_process_rollback_is_bitwise_exact(rolled_back, prepared_data, tmp_path):
    """Same parameters, bit for bit, as a fault-free run told to skip the same samples."""
    [skip] = [e["skip"] for e in read_all(Path(rolled_back.job_dir) / EVENTS) if e["event"] == "anomaly"]
    clean = direct_job(tmp_path, prepared_data, stage={"skip_samples": [skip]})
    train(clean, CPU0)
    a, b = final_model(rolled_back), final_model(clean)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_too_many_rollbacks_still_stop_the_stage(prepared_data, tmp_path):
    cfg = direct_job(
        tmp_path,
        prepared_data,
        fault_tolerance={"max_rollbacks": 0},
        chaos=[drill_from_dict({"kind": "nan_loss", "step": 5, "rank": 0})],
    )
    with pytest.raises(TooManyRollbacks, match="max_rollbacks=0"):
        train(cfg, CPU0)


def test_with_nothing_to_roll_back_to_the_worker_stops_for_a_restart(prepared_data, tmp_path):
    """A NaN at step 2, before the first checkpoint (step 4): only fresh processes can start the
    model over, so the anomaly ends the worker (the agent restarts it), its window recorded."""
    cfg = direct_job(tmp_path, prepared_data, chaos=[drill_from_dict({"kind": "nan_loss", "step": 2, "rank": 0})])
    with pytest.raises(LossAnomaly, match="step 2"):
        train(cfg, CPU0)
    assert [s["step"] for s in read_skips(cfg.job_dir)] == [2]
    assert not [e for e in read_all(Path(cfg.job_dir) / EVENTS) if e["event"] == "rollback"]


@pytest.mark.parametrize("kept, forget, left", [(5, 2, 3), (5, 0, 5), (2, 5, 0), (3, -1, 3)])
def test_the_spike_detector_forgets_the_steps_to_be_redone(kept, forget, left):
    spikes = SpikeDetector(window=10, zscore=8.0, min_steps=2)
    for i in range(kept):
        spikes.check(1.0 + i)
    spikes.forget(forget)
    assert list(spikes.losses) == [1.0 + i for i in range(left)]
