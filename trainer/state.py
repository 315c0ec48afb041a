"""Saving and restoring a worker's training state through the atomic checkpoint protocol.

Rank 0 writes the replicated state (model, optimizer, scheduler) once; every rank writes its
own shard (RNG, data position). The ranks exchange shard digests, then rank 0 commits the
manifest and pointer; nobody continues before the commit, so a restart never sees a
checkpoint that some rank has not finished.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer import checkpoint as ckpt
from trainer.config import JobConfig
from trainer.dist import DistInfo, all_gather_object, broadcast_object

MODEL_SHARD = "model.pt"


def schedule_state(cfg: JobConfig, step: int) -> dict:
    """The learning-rate schedule is a pure function of the step (``model.lr_at``); its
    parameters are stored so a checkpoint says which schedule produced it."""
    o = cfg.optim
    return {"kind": "warmup_cosine", "step": step, "lr": o.lr, "min_lr": o.min_lr,
            "warmup_steps": o.warmup_steps, "total_steps": o.steps}


@dataclass(frozen=True)
class Restored:
    step: int  # completed optimizer steps in this stage
    consumed: int  # global sample position in this stage's data order
    source: str  # "checkpoint" | "init_from" | "scratch"
    checkpoint: str | None  # directory the state came from


def save(cfg: JobConfig, info: DistInfo, *, step: int, consumed: int, model, optimizer) -> ckpt.CheckpointRef:
    shards = []
    if info.rank == 0:
        shards.append(ckpt.write_shard(cfg.ckpt_dir, step, MODEL_SHARD, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": schedule_state(cfg, step), "step": step,
        }))
    rank_state = {"rng_cpu": torch.get_rng_state(), "consumed": consumed, "step": step, "rank": info.rank}
    if info.device.type == "cuda":
        rank_state["rng_cuda"] = torch.cuda.get_rng_state(info.device)
    shards.append(ckpt.write_shard(cfg.ckpt_dir, step, ckpt.rank_shard_name(info.rank), rank_state))
    gathered = [entry for per_rank in all_gather_object(shards) for entry in per_rank]
    ref = None
    if info.rank == 0:
        ref = ckpt.commit(cfg.ckpt_dir, step, gathered, {
            "stage": cfg.stage, "world_size": info.world_size, "consumed": consumed,
        })
        ckpt.prune(cfg.ckpt_dir, cfg.ckpt_keep)
        ref = ref.to_dict()
    ref = broadcast_object(ref)  # every rank waits for the commit
    return ckpt.CheckpointRef(ref["step"], ref["path"])


def restore(cfg: JobConfig, info: DistInfo, *, model, optimizer) -> Restored:
    """Load the newest complete checkpoint of this stage, else ``init_from``, else nothing.
    Rank 0 picks the checkpoint and broadcasts it, so all ranks load the same step."""
    choice = None
    if info.rank == 0:
        ref = ckpt.latest_complete(cfg.ckpt_dir)
        if ref is not None:
            choice = ("checkpoint", str(ref.path))
        elif cfg.init_from:
            choice = ("init_from", cfg.init_from)
    choice = broadcast_object(choice)
    if choice is None:
        return Restored(0, 0, "scratch", None)
    source, path = choice
    state = ckpt.load_shard(path, MODEL_SHARD, map_location=info.device)
    model.load_state_dict(state["model"])
    if source == "init_from":
        if cfg.init_optimizer:  # moments carry over; the new stage's schedule sets the lr
            optimizer.load_state_dict(state["optimizer"])
        return Restored(0, 0, source, path)
    optimizer.load_state_dict(state["optimizer"])
    mine = ckpt.load_shard(path, ckpt.rank_shard_name(info.rank))
    torch.set_rng_state(mine["rng_cpu"])
    if "rng_cuda" in mine and info.device.type == "cuda":
        torch.cuda.set_rng_state(mine["rng_cuda"], info.device)
    return Restored(int(state["step"]), int(mine["consumed"]), source, path)
