"""Cluster tasks: Kubernetes preflight (before anything starts there) and node health checks."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from pretrain.cluster.factory import make_cluster
from pretrain.cluster.local import ClusterError, judge_nodes
from pretrain.run.jobs import threads_per_worker
from pretrain.spec.campaign import CampaignSpec
from tasks.artifacts import artifact_key


def chaos_delays(spec: CampaignSpec) -> dict[int, float]:
    """Ranks slowed down from the start by ``slow_worker`` drills (their node check is slowed
    too; a drill from a later step slows the node check after a restart instead)."""
    return {d.rank: d.delay_s for d in spec.chaos if d.kind == "slow_worker" and d.step <= 1}


@task(name="check-kubernetes", cache_policy=NO_CACHE)
def check_kubernetes(spec: CampaignSpec, vocab_size: int | None = None) -> dict:
    """Before any training on a Kubernetes cluster: publish the stages' manifests as an artifact
    for review, then check the API, the namespace and the RBAC of the credentials in use
    (PreflightError listing everything to fix)."""
    from pretrain.cluster.kube.client import api_client
    from pretrain.cluster.kube.preflight import manifests_markdown, preflight

    logger = get_run_logger()
    create_markdown_artifact(
        key=artifact_key("kubernetes-manifests", spec.name),
        markdown=manifests_markdown(spec, vocab_size),
        description=f"Kubernetes manifests of the stages of campaign {spec.name}",
    )
    result = preflight(api_client(), spec.cluster.kubernetes.namespace)
    for note in result.notes:
        logger.warning(note)
    result.raise_if_failed()
    logger.info(
        "Kubernetes preflight passed: %s, namespace %s, every verb the backend uses is allowed",
        result.server,
        result.namespace,
    )
    return {"server": result.server, "namespace": result.namespace}


def _why(row: dict) -> str:
    reason = row.get("error") or f"{row['relative']}× the median node's matmul time"
    return f"node {row['node']} worker {row['local_rank']}: {reason}"


@task(name="check-nodes", cache_policy=NO_CACHE)
def check_nodes(spec: CampaignSpec) -> dict:
    """Health-check every worker slot; exclude nodes that fail or are slower than the threshold
    × the median. Fails if fewer than ``cluster.nodes_min`` nodes remain."""
    logger = get_run_logger()
    rows = make_cluster(spec.cluster, threads_per_worker(spec), campaign=spec).health_check(
        spec.workdir_path, chaos_delays(spec)
    )
    rows, excluded = judge_nodes(rows, spec.fault_tolerance.node_check_threshold)
    for r in rows:
        logger.info(
            "node %s worker %s: matmul %.3fs (%s× median), allreduce %s MB/s%s",
            r["node"],
            r["local_rank"],
            r.get("matmul_s", float("nan")),
            r["relative"],
            r.get("allreduce_MBps", "-"),
            " — EXCLUDED" if r["excluded"] else "",
        )
    create_table_artifact(
        key=artifact_key("node-check", spec.name),
        table=[
            {k: r.get(k) for k in ("node", "local_rank", "matmul_s", "relative", "allreduce_MBps", "excluded", "error")}
            for r in rows
        ],
        description=f"Node health check of campaign {spec.name}",
    )
    healthy = spec.cluster.nodes_in_use(len(excluded))
    if healthy < spec.cluster.nodes_min:
        raise ClusterError(
            f"node health check: {healthy} healthy node(s), cluster.nodes_min is {spec.cluster.nodes_min}; "
            "failing checks: " + "; ".join(_why(r) for r in rows if r["excluded"])
        )
    if excluded:
        logger.warning("excluding node(s) %s from training", sorted(excluded))
    return {"rows": rows, "excluded": sorted(excluded)}
