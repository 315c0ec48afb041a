"""Which cluster a campaign's spec runs on: ``make_cluster`` (local processes here; the Kubernetes
backend, imported only when a spec asks for it, in ``pretrain.cluster.kube``)."""

from __future__ import annotations

from collections.abc import Mapping

from pretrain.cluster.local import Cluster, ClusterError, LocalCluster, not_runnable
from pretrain.settings import PretrainSettings
from pretrain.spec.cluster import ClusterSpec


def make_cluster(
    spec: ClusterSpec,
    threads_per_worker: int = 1,
    env: Mapping[str, str] | None = None,
    settings: PretrainSettings | None = None,
    campaign=None,
) -> Cluster:
    """The cluster of ``spec``; ``env`` is the environment its training processes get (None: this
    process's); ``settings``: None reads this process's environment. ``campaign``: the whole
    CampaignSpec, which a Kubernetes cluster needs (names, tracking, workdir). A Kubernetes
    cluster's API client comes from this process's environment (KUBECONFIG or in-cluster)."""
    settings = settings or PretrainSettings.from_env()
    if spec.kind == "local":
        return LocalCluster(spec, threads_per_worker, env=env, settings=settings)
    if spec.kind == "kubernetes":
        if why := not_runnable(spec):
            raise ClusterError(why)
        if campaign is None:
            raise ClusterError("a Kubernetes cluster is made from the campaign's whole spec (make_cluster(campaign=…))")
        from pretrain.cluster.kube.client import api_client
        from pretrain.cluster.kube.cluster import KubeCluster

        return KubeCluster(campaign, api_client(), settings)
    raise ClusterError(f"cluster.kind {spec.kind!r} is not supported yet")
