"""Node health check, run in one process per worker slot
(``python -m trainer.healthcheck --rank R --world W --master-port P --workdir DIR``).

Each process times a fixed matmul workload, then all of them join a gloo group on 127.0.0.1
(or NCCL on GPU) and time an allreduce. Each prints one JSON line; the orchestrator compares
the rows (``trainer.resilience.node_judgement``: relative to the median node) and excludes slow or failing nodes
before workers start. After an in-job restart the workers repeat the matmul part among
themselves (``trainer.resilience.nodecheck``).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


def matmul_seconds(n: int = 256, reps: int = 6, trials: int = 5, extra_delay_s: float = 0.0) -> float:
    """CPU seconds of a fixed matmul workload on one thread, the fastest of ``trials`` runs.
    CPU time, not wall time, and the best run, not the mean: node checks of a local cluster
    share the machine's cores with whatever else runs, and contention is not slowness."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(trials):
        t0 = time.process_time()
        for _ in range(reps):
            a @ b
            spin_until = time.process_time() + extra_delay_s
            while time.process_time() < spin_until:  # chaos drill slow_worker: a straggler burns extra CPU
                pass
        best = min(best, time.process_time() - t0)
    return best


def allreduce_mbps(
    rank: int, world: int, port: int, megabytes: int = 4, reps: int = 5, host: str = "127.0.0.1"
) -> float:
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        t = torch.ones(megabytes * (1 << 20) // 4)
        dist.all_reduce(t)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        return megabytes * reps / (time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
