"""Which nodes a node check excludes, from its rows (one per worker slot: ``trainer.healthcheck``
locally or in pods, ``trainer.resilience.nodecheck`` after an in-job restart). Pure: the
orchestrator imports it without torch."""

from __future__ import annotations

import statistics


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
