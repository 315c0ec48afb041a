"""The node check: the same measurement and the same rule wherever it runs.

Before training, one process per worker slot (``python -m trainer.nodecheck``, locally or in the
pods of a Kubernetes node check) times a fixed matmul workload (:func:`matmul_seconds`), then all
of them join a gloo group and time an allreduce (:func:`allreduce_mbps`); the orchestrator judges
the rows relative to the median node (:func:`judge_nodes`) and excludes slow or failing nodes.
After an in-job restart the workers repeat the matmul part among themselves before they load
state (:func:`check_after_restart`): a node slower than ``node_check_threshold`` × the median node
is excluded, as long as at least ``nodes_min`` nodes remain; its workers leave an exclusion marker
in the job directory, which that node's agent acts on by stopping the whole node. The other
nodes' agents then restart their workers without it (elastic shrink, same global batch), and the
orchestrator re-checks the node later.

Pure Python at import: the orchestrator imports :func:`judge_nodes` without torch.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.job.config import JobConfig
from trainer.job.events import EventKind
from trainer.job.layout import JobLayout

if TYPE_CHECKING:
    from trainer.dist import DistInfo

NODE_ENV = "PRETRAIN_NODE"  # set by the node agent: the node's index in the cluster


def exclusion_marker(job_dir: str | Path, node: int) -> Path:
    return JobLayout.of(job_dir).exclusion_marker(node)


def this_node() -> int:
    return int(os.environ.get(NODE_ENV, "0"))


def check_after_restart(cfg: JobConfig, info: DistInfo, extra_delay_s: float, report) -> set[int]:
    """Run the check among all ranks; returns the excluded nodes (and marks this one if it is)."""
    from trainer.dist import all_gather_object

    node = this_node()
    mine = {
        "rank": info.rank,
        "node": node,
        "ok": True,
        "matmul_s": round(matmul_seconds(extra_delay_s=extra_delay_s), 4),
    }
    rows, excluded = judge_nodes(all_gather_object(mine), cfg.fault_tolerance.node_check_threshold)
    nodes = {r["node"] for r in rows}
    if len(nodes) - len(excluded) < cfg.cluster.nodes_min:
        excluded = set()  # too few would remain: keep training on all of them
    if info.rank == 0:
        report({"event": EventKind.NODE_CHECK, "rows": rows, "excluded": sorted(excluded)})
    if node in excluded:
        exclusion_marker(cfg.job_dir, node).touch()
    return excluded


def judge_nodes(rows: list[dict], threshold: float) -> tuple[list[dict], set[int]]:
    """Judge *nodes*: a node's time is its slowest worker slot's; a node is excluded if any of
    its checks failed or its time exceeds ``threshold`` × the median node time. Each row gets
    its time relative to that median. (A lone node can only fail, never be "slow".)"""
    node_times: dict[int, float] = {}
    for r in rows:
        if r["ok"]:
            node_times[r["node"]] = max(node_times.get(r["node"], 0.0), r["matmul_s"])
    median = (
        statistics.median_low(node_times.values()) if node_times else 0.0
    )  # low median: one straggler of two stands out
    failed = {r["node"] for r in rows if not r["ok"]}
    excluded = failed | {n for n, t in node_times.items() if median and t / median > threshold}
    for r in rows:
        r["relative"] = round(r["matmul_s"] / median, 2) if r["ok"] and median else None
        r["excluded"] = r["node"] in excluded
    return rows, excluded


def matmul_seconds(n: int = 256, reps: int = 6, trials: int = 5, extra_delay_s: float = 0.0) -> float:
    """CPU seconds of a fixed matmul workload on one thread, the fastest of ``trials`` runs.
    CPU time, not wall time, and the best run, not the mean: node checks of a local cluster
    share the machine's cores with whatever else runs, and contention is not slowness."""
    import torch

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
    import torch
    import torch.distributed as dist

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
