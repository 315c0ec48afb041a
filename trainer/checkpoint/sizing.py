"""How large a rank's shared-memory snapshot slot must be, known before the model is built (no torch:
the orchestrator sizes a pod's shared memory with it)."""

from __future__ import annotations

from trainer.job.config import JobConfig

HEADER_BYTES = 4096  # a slot's header: the layout record of what it holds
PAGE = 4096


def snapshot_capacity(cfg: JobConfig, rank: int, world_size: int = 1) -> int:
    """Bytes one shared-memory slot needs, known before the model is built: fp32 model (its
    state dict lists the tied embedding twice) + two AdamW moments — on rank 0, where the DDP
    replica is snapshotted, or a 1/world piece (plus a row of rounding per tensor) on every
    FSDP rank; RNG and data position on every rank; room for the layout record."""
    m = cfg.model
    model_bytes = 4 * (m.num_params() + m.vocab_size * m.d_model)
    if cfg.cluster.parallelism == "fsdp":
        rounding = 4 * 4 * m.d_model * (12 * m.n_layer + 8)  # at most one (≤ 4·d_model wide) row per tensor
        return 3 * (-(-model_bytes // world_size) + rounding) + (1 << 20)
    return (3 * model_bytes if rank == 0 else 0) + (1 << 20)
