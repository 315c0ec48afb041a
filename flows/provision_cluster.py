"""Flow: make sure the cluster can run the campaign (on Kubernetes: API, namespace and RBAC first;
then the node health check on every node)."""

from __future__ import annotations

from prefect import flow

from flows.locking import holds_campaign_lock
from pretrain.ledger import Ledger
from pretrain.ledger_schema import ClusterRecord
from pretrain.spec import CampaignSpec
from tasks.cluster import check_kubernetes, check_nodes
from tasks.tracking import tracker_for


@flow(name="provision-cluster")
@holds_campaign_lock
def provision_cluster(spec: CampaignSpec) -> dict:
    ledger = Ledger.open(spec)
    if spec.cluster.kind == "kubernetes":
        check_kubernetes(spec, ledger.record.data.vocab_size if ledger.record.data else None)
    check = check_nodes(spec)
    info = ClusterRecord(kind=spec.cluster.kind, nodes=spec.cluster.nodes_in_use(len(check["excluded"])),
                         workers_per_node=spec.cluster.workers_per_node, excluded=check["excluded"], health=check["rows"])
    ledger.set_cluster(info)
    run_id = ledger.record.mlflow.parent_run_id
    if run_id:
        tracker = tracker_for(spec)
        tracker.client.log_dict(run_id, check["rows"], "node_check.json")
        tracker.set_tags(run_id, {"cluster.excluded_nodes": ",".join(map(str, check["excluded"])) or "none"})
    return info
