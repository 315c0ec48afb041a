"""Rolling a loss anomaly back in memory, without a process restart.

On a NaN/Inf loss or a spike at step s no process needs replacing: every rank sees the same
(all-reduced) loss, so all of them take this path together. Rank 0 records the step's global
batch as a skip window; after a barrier every rank re-reads the stage's skip windows (too many
rollbacks still stop the stage), restores model, optimizer, RNG and data position through
``state.restore`` — the newest snapshot every rank holds and verifies (agreed through the
existing process group), else the newest committed checkpoint — and the loop continues from
there. The result is the state a restarted worker would load, so recovery stays bitwise exact;
what is saved is the restart: new processes, ``import torch``, rendezvous, a new process group.
Under FSDP every rank restores its own pieces from its own slot (tests/support/fsdp_ranks.py checks
the restore into live FSDP modules bit for bit). When only a cold start could help (no snapshot
and no checkpoint: the model would have to be built from scratch), the anomaly is raised and the
elastic agent restarts the workers as before.
"""

from __future__ import annotations

import time

from trainer.checkpoint import state
from trainer.dist import DistInfo, broadcast_object
from trainer.job.config import JobConfig
from trainer.job.events import IN_PROCESS_SOURCES, EventKind
from trainer.resilience.anomaly import LossAnomaly, SpikeDetector, TooManyRollbacks, read_skips, skips_path


def skip_windows(cfg: JobConfig) -> list[tuple[int, int]]:
    """The spec's skip windows plus those recorded by rollbacks in this stage; too many
    rollbacks stop the stage for a human to look at."""
    recorded = read_skips(cfg.job_dir)
    most = cfg.fault_tolerance.max_rollbacks
    if len(recorded) > most:
        raise TooManyRollbacks(
            f"{len(recorded)} loss anomalies in stage {cfg.stage.name} (max_rollbacks={most}): "
            f"inspect the skipped samples in {skips_path(cfg.job_dir)}, lower the learning rate or "
            "raise fault_tolerance.max_rollbacks"
        )
    return [tuple(w) for w in cfg.stage.skip_samples] + [(s["start"], s["end"]) for s in recorded]


def roll_back(
    cfg: JobConfig, info: DistInfo, err: LossAnomaly, *, model, optimizer, snapshots, spikes: SpikeDetector, write_event
) -> tuple[state.Restored, list[tuple[int, int]]]:
    """Every rank, after ``err`` (its skip window already recorded by rank 0): the restored
    state and the skip windows from now on; raises ``err`` when fresh processes are needed."""
    t0 = time.perf_counter()
    broadcast_object(None)  # rank 0 has recorded the skip window
    windows = skip_windows(cfg)
    optimizer.zero_grad(set_to_none=True)  # the anomalous step's gradients
    restored = state.restore(cfg, info, model=model, optimizer=optimizer, snapshots=snapshots)
    if restored.source not in IN_PROCESS_SOURCES:
        raise err
    spikes.forget(err.step - 1 - restored.step)  # the losses of the steps about to be redone
    if info.rank == 0:
        write_event(
            {
                "event": EventKind.ROLLBACK,
                "rank": info.rank,
                "path": "in_process",
                "anomaly_step": err.step,
                "step": restored.step,
                "source": restored.source,
                "checkpoint": restored.checkpoint,
                "seconds": round(time.perf_counter() - t0, 4),
            }
        )
    return restored, windows
