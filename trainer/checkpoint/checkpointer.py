"""The checkpointer of the training loop (``trainer.loop``): it decides when a checkpoint is due
and takes it, written directly or as a flash snapshot into the rank's shared-memory slots."""

from __future__ import annotations

import time

from trainer.checkpoint import state
from trainer.checkpoint.flash import SnapshotStore
from trainer.checkpoint.shm import ShmTooSmall
from trainer.checkpoint.sizing import snapshot_capacity
from trainer.dist import DistInfo, local_world_size
from trainer.job.config import JobConfig
from trainer.job.events import EventKind
from trainer.job.reporting import JsonLines


class Checkpointer:
    """Decides when a checkpoint is due and takes it: persisted every ``checkpoint.interval`` steps and at
    the stage's last step; with flash snapshots (``snapshots``; None: checkpoints written directly)
    also copied into shared memory every ``memory_interval`` steps, persisted by the node's saver."""

    def __init__(self, cfg: JobConfig, info: DistInfo, snapshots, events: JsonLines, *, model, optimizer):
        self.cfg, self.info, self.snapshots, self.events = cfg, info, snapshots, events
        self.model, self.optimizer = model, optimizer

    def save(self, step: int, *, consumed: int, loss: float | None = None) -> float | None:
        """Take the checkpoint due at ``step``, if any; returns the seconds training was blocked (the
        state gathered and saved, or copied into shared memory), None if no checkpoint was due."""
        cfg, info, snapshots, events = self.cfg, self.info, self.snapshots, self.events
        model, optimizer = self.model, self.optimizer
        last = step == cfg.stage.steps
        persist = step % cfg.checkpoint.interval == 0 or last
        if snapshots is None:
            if not persist:
                return None
            t0 = time.perf_counter()
            ref = state.save(cfg, info, step=step, consumed=consumed, model=model, optimizer=optimizer, loss=loss)
            if info.rank == 0:
                events.write({"event": EventKind.CHECKPOINT, "step": step, "path": str(ref.path)})
            return time.perf_counter() - t0
        if not (persist or step % cfg.checkpoint.memory_interval == 0):
            return None
        t0 = time.perf_counter()  # training waits for the state dict to be gathered as well as copied
        st = state.training_state(cfg, info, step=step, consumed=consumed, model=model, optimizer=optimizer, loss=loss)
        if snapshots.snapshot(step, st, persist=persist, wait=last) is None:
            events.write({"event": EventKind.SNAPSHOT_SKIPPED, "rank": info.rank, "step": step, "reason": "slot busy"})
        return time.perf_counter() - t0

    def flush(self) -> None:
        """After the last step, with flash snapshots: until the saver persisted them and the last
        step's checkpoint is committed."""
        self.snapshots.flush()
        state.wait_committed(self.cfg, self.info, self.cfg.stage.steps)


def checkpoint(
    cfg: JobConfig,
    info: DistInfo,
    snapshots,
    events: JsonLines,
    *,
    step: int,
    consumed: int,
    model,
    optimizer,
    loss: float | None = None,
) -> float | None:
    """Take the checkpoint due at ``step``, if any (``Checkpointer.save``); returns the seconds
    training was blocked, None if no checkpoint was due."""
    return Checkpointer(cfg, info, snapshots, events, model=model, optimizer=optimizer).save(
        step, consumed=consumed, loss=loss
    )


def open_snapshots(cfg: JobConfig, info: DistInfo, capacity: int, shm_ns: str | None, events: JsonLines):
    """The rank's snapshot slots, allocated and touched now (off the training path); None for
    direct checkpoints (no shared memory configured, or too little of it with fallback on)."""
    if not shm_ns:
        return None
    first = info.rank - info.local_rank  # ranks are laid out node by node
    node = {lr: snapshot_capacity(cfg, first + lr, info.world_size) for lr in range(local_world_size())}
    try:
        return SnapshotStore(shm_ns, info.local_rank, info.rank, info.world_size, capacity, node)
    except ShmTooSmall as err:
        if not cfg.checkpoint.shm_fallback:
            raise
        events.write({"event": EventKind.SHM_FALLBACK, "rank": info.rank, "reason": str(err)})
        return None
