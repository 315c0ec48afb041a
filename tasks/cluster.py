"""Cluster tasks: node health checks."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pretrain.cluster import ClusterError, make_cluster
from pretrain.jobs import threads_per_worker
from pretrain.spec import CampaignSpec


@task(name="check-nodes", cache_policy=NO_CACHE)
def check_nodes(spec: CampaignSpec) -> list[dict]:
    """Run the health check on every node; fail naming the nodes that did not pass."""
    logger = get_run_logger()
    rows = make_cluster(spec.cluster, threads_per_worker(spec)).health_check(spec.workdir_path)
    for row in rows:
        logger.info("node %s: %s", row["node"], {k: v for k, v in row.items() if k != "node"})
    bad = [r for r in rows if not r["ok"]]
    if bad:
        raise ClusterError("node health check failed on " + ", ".join(f"node {r['node']}: {r.get('error', '?')}" for r in bad))
    return rows
