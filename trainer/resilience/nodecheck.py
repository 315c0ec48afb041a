"""Node check after an in-job restart, run by the workers themselves before they load state.

Every worker times the matmul workload of ``trainer.healthcheck``; the ranks gather the times
with their node index, and a node slower than ``node_check_threshold`` × the median node (the
same rule as the check before training) is excluded, as long as at least ``nodes_min`` nodes
remain: its workers leave an exclusion marker in the job directory, which that node's agent
acts on by stopping the whole node. The other nodes' agents then restart their workers
without it (elastic shrink, same global batch), and the orchestrator re-checks the node later.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainer.dist import DistInfo, all_gather_object
from trainer.job.config import JobConfig
from trainer.job.events import EventKind
from trainer.resilience.healthcheck import matmul_seconds
from trainer.resilience.node_judgement import judge_nodes

NODE_ENV = "PRETRAIN_NODE"  # set by the node agent: the node's index in the cluster


def exclusion_marker(job_dir: str | Path, node: int) -> Path:
    return Path(job_dir) / f"exclude_node_{node}"


def this_node() -> int:
    return int(os.environ.get(NODE_ENV, "0"))


def check_after_restart(cfg: JobConfig, info: DistInfo, extra_delay_s: float, report) -> set[int]:
    """Run the check among all ranks; returns the excluded nodes (and marks this one if it is)."""
    node = this_node()
    mine = {
        "rank": info.rank,
        "node": node,
        "ok": True,
        "matmul_s": round(matmul_seconds(extra_delay_s=extra_delay_s), 4),
    }
    rows, excluded = judge_nodes(all_gather_object(mine), cfg.node_check_threshold)
    nodes = {r["node"] for r in rows}
    if len(nodes) - len(excluded) < cfg.nodes_min:
        excluded = set()  # too few would remain: keep training on all of them
    if info.rank == 0:
        report({"event": EventKind.NODE_CHECK, "rows": rows, "excluded": sorted(excluded)})
    if node in excluded:
        exclusion_marker(cfg.job_dir, node).touch()
    return excluded
