"""A small job config for trainer-level tests, filled from a spec exactly as the orchestrator
fills it (``pretrain.run.jobs.job_config``): the spec is the one source of every default; a model
trained a few steps on it, and a bit-exact comparison of training states."""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.run.jobs import job_config
from pretrain.spec.campaign import parse_spec
from trainer.dist import DistInfo
from trainer.job.config import JobConfig
from trainer.loop import build_model

CPU0 = DistInfo(rank=0, local_rank=0, world_size=1, restart_count=0, device=torch.device("cpu"), backend="gloo")


def tiny_job(
    root: Path,
    *,
    parallelism: str = "ddp",
    vocab_size: int = 64,
    max_seq_len: int = 32,
    steps: int = 20,
    lr: float = 1e-3,
    min_lr: float = 1e-4,
    **changes,
) -> JobConfig:
    """A 2-layer GPT (d_model 16) trained on micro-batches of 2 × 8 tokens; its data, checkpoints
    and job directory under ``root``; no memory snapshots, and one optimizer step takes one
    micro-batch per worker whatever the world size. ``changes``: other JobConfig fields (``JobConfig.amended``)."""
    spec = parse_spec(
        {
            "name": "t",
            "workdir": str(root),
            "seed": 1,
            "model": {"n_layer": 2, "n_head": 2, "d_model": 16, "max_seq_len": max_seq_len},
            "cluster": {"workers_per_node": 1, "parallelism": parallelism},
            "stages": [
                {
                    "name": "s",
                    "steps": steps,
                    "lr": lr,
                    "min_lr": min_lr,
                    "warmup_steps": 1,
                    "micro_batch": 2,
                    "seq_len": 8,
                }
            ],
            "checkpoint": {"memory_interval": 0},
        }
    )
    job = job_config(spec, 0, 0, None, vocab_size)
    root = Path(root)
    fixed = {
        "data": {"uri": str(root / "data")},
        "checkpoint": {"location": str(root / "ckpt")},
        "stage": {"global_batch": 0},
        "cluster": {"threads_per_worker": 0},
    }
    for name, value in changes.items():
        fixed[name] = {**fixed[name], **value} if name in fixed else value
    return job.amended(job_dir=str(root / "job"), **fixed)


def trained(cfg: JobConfig, steps: int = 2):
    """A model and optimizer with real AdamW state."""
    torch.manual_seed(0)
    model, opt = build_model(cfg, torch.device("cpu"))
    for _ in range(steps):
        model(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b
