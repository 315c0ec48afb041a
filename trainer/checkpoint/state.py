"""Saving and restoring a worker's training state through the atomic checkpoint protocol.

Under DDP rank 0 writes the replicated state (model, optimizer, scheduler) once; under FSDP
every rank writes its piece of it (``trainer.checkpoint.sharded``). Every rank writes its own shard (RNG,
data position). The ranks exchange shard digests, then rank 0 commits the
manifest and pointer; nobody continues before the commit, so a restart never sees a
checkpoint that some rank has not finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.checkpoint import store as ckpt
from trainer.checkpoint.flash import SnapshotStore
from trainer.checkpoint.flat import Layout, read_state, write_tensors
from trainer.checkpoint.handoff import hand_over, signature
from trainer.checkpoint.sharded import apply_sharded, load_full_state, localize
from trainer.checkpoint.store import CheckpointStore, stage_store
from trainer.dist import DistInfo, all_gather_object, broadcast_object, is_initialized, local_world_size
from trainer.job.config import JobConfig
from trainer.job.events import SURVIVORS

MODEL_SHARD = ckpt.MODEL_SHARD


def is_sharded(cfg: JobConfig) -> bool:
    """Does every rank hold only its piece of model and optimizer (FSDP)?"""
    return cfg.cluster.parallelism == "fsdp"


def schedule_state(cfg: JobConfig, step: int) -> dict:
    """The learning-rate schedule is a pure function of the step (``model.lr_at``); its
    parameters are stored so a checkpoint says which schedule produced it."""
    o = cfg.stage
    return {
        "kind": "warmup_cosine",
        "step": step,
        "lr": o.lr,
        "min_lr": o.min_lr,
        "warmup_steps": o.warmup_steps,
        "total_steps": o.steps,
    }


@dataclass(frozen=True)
class Restored:
    step: int  # completed optimizer steps in this stage
    consumed: int  # global sample position in this stage's data order
    source: str  # "survivors" | "memory" | "checkpoint" | "init_from" | "scratch"
    checkpoint: str | None  # directory the state came from


def training_state(
    cfg: JobConfig, info: DistInfo, *, step: int, consumed: int, model, optimizer, loss: float | None = None
) -> dict:
    """What a checkpoint holds for this rank: ``shared`` (replicated under DDP, so rank 0 only:
    model, optimizer, schedule) or, under FSDP, ``shard`` (every rank: its pieces of model and
    optimizer, the schedule); and ``rank`` (this rank's RNG, data position, and the training loss
    of the step, which the validation gate's probe compares against)."""
    rank_state = {"rng_cpu": torch.get_rng_state(), "consumed": consumed, "step": step, "rank": info.rank, "loss": loss}
    if info.device.type == "cuda":
        rank_state["rng_cuda"] = torch.cuda.get_rng_state(info.device)
    out = {"rank": rank_state}
    if is_sharded(cfg):
        out["shard"] = {
            "model": localize(model.state_dict(), "model"),
            "optimizer": localize(optimizer.state_dict(), "optimizer"),
            "scheduler": schedule_state(cfg, step),
            "step": step,
        }
    elif info.rank == 0:
        out["shared"] = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": schedule_state(cfg, step),
            "step": step,
        }
    return out


def save(
    cfg: JobConfig, info: DistInfo, *, step: int, consumed: int, model, optimizer, loss: float | None = None
) -> ckpt.CheckpointRef:
    """Direct (synchronous) save to storage, used when shared-memory snapshots are off."""
    st = training_state(cfg, info, step=step, consumed=consumed, model=model, optimizer=optimizer, loss=loss)
    store = stage_store(cfg)
    shards = []
    if "shared" in st:
        shards.append(store.write_shard(step, MODEL_SHARD, st["shared"]))
    if "shard" in st:
        shards.append(store.write_shard(step, ckpt.model_shard_name(info.rank), st["shard"]))
    shards.append(store.write_shard(step, ckpt.rank_shard_name(info.rank), st["rank"]))
    gathered = [entry for per_rank in all_gather_object(shards) for entry in per_rank]
    if info.rank == 0:
        store.commit(
            step,
            gathered,
            {
                **cfg.checkpoint_meta(),
                "world_size": info.world_size,
                "consumed": consumed,
                "parallelism": cfg.cluster.parallelism,
            },
        )
        store.prune(cfg.checkpoint.keep)
    broadcast_object(None)  # every rank waits for the commit
    return store.ref(step)


def _load_model(cfg: JobConfig, model_state: dict, model, optimizer) -> None:
    """Model (and, unless ``optimizer`` is None, optimizer) state into this run's layout:
    under FSDP the state may be this rank's pieces or full tensors (cut locally)."""
    if is_sharded(cfg):
        apply_sharded(model, optimizer, model_state)
        return
    model.load_state_dict(model_state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(model_state["optimizer"])


def _model_state(cfg: JobConfig, info: DistInfo, store: ckpt.CheckpointStore, step: int) -> dict:
    """The checkpoint's model state as this rank needs it: its own piece when an FSDP run
    resumes an FSDP checkpoint of the same world size; otherwise the full state (consolidated
    from the pieces if the checkpoint is sharded), which FSDP then cuts into this rank's piece."""
    manifest = store.manifest(step)
    if (
        is_sharded(cfg)
        and manifest is not None
        and manifest.world_size == info.world_size
        and ckpt.model_shard_name(info.rank) in manifest.files
    ):
        return store.load_shard(step, ckpt.model_shard_name(info.rank), map_location=info.device)
    return load_full_state(store, step, map_location=info.device)


def _with_own_rng(rank_state: dict) -> dict:
    """Another rank's state (its data position, global) with this process's own RNG stream: for a
    rank that holds no state of its own (unused under DDP without dropout)."""
    mine = {**rank_state, "rng_cpu": torch.get_rng_state()}
    mine.pop("rng_cuda", None)
    return mine


def _apply(cfg: JobConfig, info: DistInfo, model_state: dict, mine: dict, model, optimizer) -> None:
    _load_model(cfg, model_state, model, optimizer)
    torch.set_rng_state(mine["rng_cpu"])
    if "rng_cuda" in mine and info.device.type == "cuda":
        torch.cuda.set_rng_state(mine["rng_cuda"], info.device)


def newest_common_snapshot(
    snapshots: SnapshotStore, floor: int, fresh_ranks_allowed: bool = False
) -> tuple[int, bool] | None:
    """The newest step at least ``floor`` of which every rank holds a verified snapshot, and
    whether some ranks hold none at all (``fresh_ranks_allowed``: a standby node's, in place of
    a lost node's; they take the replicated state from rank 0's snapshot). Ranks exchange their
    sealed steps (headers only), then verify candidates newest first; every rank computes the
    same candidates, so all run the same collectives."""
    sealed = snapshots.sealed_steps()
    held = [set(s) for s in all_gather_object(sorted(sealed))]
    fresh = [not h for h in held]
    if any(fresh) and (not fresh_ranks_allowed or fresh[0] or all(fresh)):
        return None
    common = set.intersection(*(h for h in held if h))
    for step in sorted((s for s in common if s >= floor), reverse=True):
        if all(all_gather_object(snapshots.verify(step) if sealed else True)):
            return step, any(fresh)
    return None


def adopted_snapshot(info: DistInfo, snapshots: SnapshotStore, floor: int) -> dict | None:
    """After the world changed size (a node lost without a standby, or one taken in): the newest
    snapshot (step ≥ ``floor``) of the last world's rank 0 — under DDP without dropout the
    replicated model and optimizer, and the global data position — on any node of this world,
    sent by the first rank that holds it to the others; None (every rank) if no node holds one."""
    held = all_gather_object(sorted(s for s in snapshots.replicated_elsewhere() if s >= floor))
    for step in sorted({s for steps in held for s in steps}, reverse=True):
        holder = min(r for r, steps in enumerate(held) if step in steps)
        snap = snapshots.load_replicated(step) if info.rank == holder else None
        if broadcast_object(snap is not None, src=holder):
            return _broadcast_state(info, snap, holder)
    return None


def any_rank_will_do(cfg: JobConfig) -> bool:
    """Can a rank that holds no state of its own take another rank's? Under DDP without dropout:
    the model and optimizer are replicated and a rank's RNG shapes nothing (with dropout it lives
    only in that rank's own snapshot; under FSDP each rank holds its own pieces)."""
    return not is_sharded(cfg) and cfg.model.dropout == 0


def kept_by_survivors(
    cfg: JobConfig, info: DistInfo, live: tuple[int, int] | None, *, model, optimizer
) -> Restored | None:
    """A fast recovery's state without a rollback (every rank of the new group calls it): the
    surviving ranks pass ``live`` (the step they completed and the data position), a replacement
    None. If the survivors agree on one step (a peer lost inside the next step changed nothing
    they hold: the update comes after the step's collectives), training goes on from it; under
    DDP without dropout the model and optimizer are replicated, so a replacement takes them from
    the first survivor over the group, tensor by tensor into its own (its own RNG is unused).
    Else None for every rank (the survivors disagree, or a rank's state is its own: FSDP's
    pieces, dropout's RNG): the newest snapshot every rank holds (:func:`restore`)."""
    # a survivor's step comes with what it holds (trainer.checkpoint.handoff), for the replacement
    lives = all_gather_object(
        None
        if live is None
        else (tuple(live), signature(model, optimizer, info.backend) if any_rank_will_do(cfg) else None)
    )
    kept = {held[0] for held in lives if held is not None}
    if len(kept) != 1 or not any_rank_will_do(cfg):
        return None
    step, consumed = kept.pop()
    if None in lives:  # straight from the survivor's tensors into the replacement's
        src = next(r for r, held in enumerate(lives) if held is not None)
        hand_over(
            info.rank,
            src,
            [r for r, held in enumerate(lives) if held is None],
            model,
            optimizer,
            info.backend,
            lives[src][1],
        )
    return Restored(step, consumed, SURVIVORS, None)


def _broadcast_state(info: DistInfo, state: dict | None, src: int) -> dict:
    """Rank ``src``'s ``state`` on every rank: under gloo its tensors travel as one flat buffer
    (the snapshots' layout, ``trainer.checkpoint.flat``), not pickled one by one."""
    if not is_initialized():
        return state
    if info.backend != "gloo":
        return broadcast_object(state, src=src)
    layout, tensors = Layout.of(state) if info.rank == src else (None, [])
    layout = Layout.from_json(broadcast_object(layout.to_json() if layout else None, src=src))
    buf = torch.empty(layout.data_bytes, dtype=torch.uint8)
    if info.rank == src:
        write_tensors(memoryview(buf.numpy()), layout, tensors)
    dist.broadcast(buf, src=src)
    return state if info.rank == src else read_state(memoryview(buf.numpy()), layout, clone=False)


def restore(cfg: JobConfig, info: DistInfo, *, model, optimizer, snapshots: SnapshotStore | None = None) -> Restored:
    """Load the newest state of this stage: from shared memory if every rank holds a verified
    snapshot of a common step at least as new as storage's (under DDP without dropout, ranks of a
    node that replaced a lost one may hold none: they take rank 0's, the replicated state, and its
    data position; after the world changed size, the last world's rank 0 snapshot where a node
    holds one: ``adopted_snapshot``); else the newest complete checkpoint; else ``init_from``;
    else nothing. Rank 0 decides and broadcasts, so all ranks load the same step."""
    choice = None
    store = stage_store(cfg)
    ref = store.latest_complete() if info.rank == 0 else None
    floor = broadcast_object(ref.step if ref else -1)
    found = newest_common_snapshot(snapshots, floor, any_rank_will_do(cfg)) if snapshots is not None else None
    if found is None and snapshots is not None and any_rank_will_do(cfg):
        adopted = adopted_snapshot(info, snapshots, floor)
        if adopted is not None:  # every rank keeps its own RNG stream (unused: no dropout)
            mine = _with_own_rng(adopted["rank"])
            _apply(cfg, info, adopted["shared"], mine, model, optimizer)
            return Restored(int(adopted["shared"]["step"]), int(mine["consumed"]), "memory", str(snapshots.ns))
    if info.rank == 0:
        if found is not None:
            choice = ("memory", found)
        elif ref is not None:
            choice = ("checkpoint", ref.location)
        elif cfg.stage.init_from:
            choice = ("init_from", cfg.stage.init_from)
    choice = broadcast_object(choice)
    if choice is None:
        return Restored(0, 0, "scratch", None)
    source, path = choice
    if source == "memory":
        step, some_fresh = path
        snap = snapshots.load(step) if step in snapshots.sealed_steps() else None
        if is_sharded(cfg):  # every rank's slot holds its own piece
            shared = snap["shard"]
        else:  # replicated state lives in rank 0's slot
            shared = _replicated(info, snapshots, snap, step)
        mine = snap["rank"] if snap is not None else None
        if some_fresh:  # a fresh rank takes rank 0's data position, and keeps its own RNG stream (unused: no dropout)
            first = broadcast_object(mine if info.rank == 0 else None)
            if mine is None:
                mine = _with_own_rng(first)
        _apply(cfg, info, shared, mine, model, optimizer)
        return Restored(int(shared["step"]), int(mine["consumed"]), "memory", str(snapshots.ns))
    src, step = CheckpointStore.of_step(path, cfg.checkpoint.options)
    state = _model_state(cfg, info, src, step)
    if source == "init_from":  # moments carry over if asked; the new stage's schedule sets the lr
        _load_model(cfg, state, model, optimizer if cfg.stage.carry_optimizer else None)
        return Restored(0, 0, source, path)
    world = manifest.world_size if (manifest := src.manifest(step)) else info.world_size
    if info.rank < world:
        mine = src.load_shard(step, ckpt.rank_shard_name(info.rank))
    else:  # the world grew: a new rank takes the (global) data position, and its own RNG stream
        mine = _with_own_rng(src.load_shard(step, ckpt.rank_shard_name(0)))
    _apply(cfg, info, state, mine, model, optimizer)
    return Restored(int(state["step"]), int(mine["consumed"]), source, path)


def _replicated(info: DistInfo, snapshots: SnapshotStore, snap, step: int) -> dict:
    """Rank 0's replicated state (model, optimizer, step) of its snapshot of ``step``: in a job of
    one node every rank reads it from rank 0's slot in this node's shared memory; across nodes
    rank 0 sends it over the process group."""
    if info.world_size == local_world_size():
        own = snap if info.rank == 0 else snapshots.load_local(0, 0, step)
        if all(all_gather_object(own is not None)):  # else every rank takes it from rank 0 as below
            return own["shared"]
    return _broadcast_state(info, snap["shared"] if info.rank == 0 else None, 0)


def wait_committed(cfg: JobConfig, info: DistInfo, step: int, timeout_s: float = 300.0) -> None:
    """Block until the saver has committed ``step`` to storage (the stage's last step must be
    durable before the job reports success)."""
    ok = True
    if info.rank == 0:
        store = stage_store(cfg)
        deadline = time.monotonic() + timeout_s
        while (store.read_pointer() or -1) < step and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the pointer the saver moves
        ok = (store.read_pointer() or -1) >= step
    if not broadcast_object(ok):
        raise TimeoutError(
            f"the checkpoint saver did not commit step {step} to {cfg.checkpoint.location} within {timeout_s:.0f}s"
        )
