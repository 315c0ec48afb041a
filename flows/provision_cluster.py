"""Flow: make sure the cluster can run the campaign (node health check on every node)."""

from __future__ import annotations

from prefect import flow

from pretrain.ledger import Ledger
from pretrain.spec import CampaignSpec
from tasks.cluster import check_nodes


@flow(name="provision-cluster")
def provision_cluster(spec: CampaignSpec) -> dict:
    rows = check_nodes(spec)
    info = {"kind": spec.cluster.kind, "nodes": len(rows), "workers_per_node": spec.cluster.workers_per_node,
            "health": rows}
    Ledger.open(spec).set(cluster=info)
    return info
