"""Flow: make sure the cluster can run the campaign (on Kubernetes: API, namespace and RBAC first;
then the node health check on every node)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.locking import holds_campaign_lock
from pretrain.spec.campaign import CampaignSpec
from pretrain.state.ledger import Ledger
from pretrain.state.schema import ClusterRecord
from pretrain.tracking.runs import describe_error, transient
from tasks.cluster import check_kubernetes, check_nodes
from tasks.tracking import log_node_check, tracker_for


@flow(name="provision-cluster")
@holds_campaign_lock
def provision_cluster(spec: CampaignSpec) -> dict:
    ledger = Ledger.open(spec)
    if spec.cluster.kind == "kubernetes":
        check_kubernetes(spec, ledger.record.data.vocab_size if ledger.record.data else None)
    check = check_nodes(spec)
    info = ClusterRecord(
        kind=spec.cluster.kind,
        nodes=spec.cluster.nodes_in_use(len(check["excluded"])),
        workers_per_node=spec.cluster.workers_per_node,
        excluded=check["excluded"],
        health=check["rows"],
    )
    ledger.set_cluster(info)
    if run_id := ledger.record.mlflow.parent_run_id:
        tracker = tracker_for(spec)
        try:
            tracker.check()  # one quick request: MLflow's own retries take minutes
            log_node_check(tracker, run_id, check["rows"], check["excluded"])
        except Exception as err:  # noqa: BLE001 - MLflow is a view of the ledger, which holds the check
            if not transient(err):
                raise
            get_run_logger().warning(
                "the node check is not logged to MLflow run %s (%s); it is in the ledger, and the campaign goes on",
                run_id,
                describe_error(err),
            )
    return info
