"""Node health check, one process per worker slot:
``python -m trainer.healthcheck --rank R --world W --master-port P --workdir DIR``.

Each process times a fixed matmul workload, then all of them join a gloo group on 127.0.0.1
(or NCCL on GPU) and time an allreduce. Each prints one JSON line; the orchestrator compares
the rows (``judge_nodes``: relative to the median node) and excludes slow or failing nodes
before workers start. After an in-job restart the workers repeat the matmul part among
themselves (``trainer.nodecheck``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.process import exit_when_orphaned


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


def allreduce_mbps(rank: int, world: int, port: int, megabytes: int = 4, reps: int = 5) -> float:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
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


def judge_nodes(rows: list[dict], threshold: float) -> tuple[list[dict], set[int]]:
    """Judge *nodes*: a node's time is its slowest worker slot's; a node is excluded if any of
    its checks failed or its time exceeds ``threshold`` × the median node time. Each row gets
    its time relative to that median. (A lone node can only fail, never be "slow".)"""
    node_times: dict[int, float] = {}
    for r in rows:
        if r["ok"]:
            node_times[r["node"]] = max(node_times.get(r["node"], 0.0), r["matmul_s"])
    median = statistics.median_low(node_times.values()) if node_times else 0.0  # low median: one straggler of two stands out
    failed = {r["node"] for r in rows if not r["ok"]}
    excluded = failed | {n for n, t in node_times.items() if median and t / median > threshold}
    for r in rows:
        r["relative"] = round(r["matmul_s"] / median, 2) if r["ok"] and median else None
        r["excluded"] = r["node"] in excluded
    return rows, excluded


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.healthcheck")
    p.add_argument("--workdir", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--extra-delay", type=float, default=0.0, help="seconds added per matmul (chaos drill)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    exit_when_orphaned()  # started by `pretrain run`: never outlive it
    torch.set_num_threads(1)
    row = {"rank": args.rank, "torch": torch.__version__, "cuda_devices": torch.cuda.device_count(),
           "matmul_s": round(matmul_seconds(extra_delay_s=args.extra_delay), 4),
           "shm_free_bytes": shutil.disk_usage("/dev/shm").free, "disk_free_bytes": shutil.disk_usage(args.workdir).free}
    if args.world > 1:
        row["allreduce_MBps"] = round(allreduce_mbps(args.rank, args.world, args.master_port), 1)
    print(json.dumps(row), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown at interpreter exit (see docs/platform.md)


if __name__ == "__main__":
    sys.exit(main())
