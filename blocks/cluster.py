"""Blocks: where a stage's training job runs — local processes, or a Kubernetes cluster (one
Indexed Job per stage launch, ``pretrain.cluster.kube``)."""

from __future__ import annotations

from abc import ABC
from typing import Literal

from prefect.blocks.core import Block
from prefect_kubernetes.credentials import KubernetesCredentials
from pydantic import Field, model_validator

from pretrain.spec.cluster import ClusterSpec
from pretrain.spec.kube import KubernetesSpec, SecretKeyRef, Toleration

_SPEC_FIELDS = ClusterSpec.model_fields


def _mirror(name: str, title: str, **constraints: int):
    """A block field with the default and description of ``ClusterSpec.<name>`` (one source of truth)."""
    src = _SPEC_FIELDS[name]
    return Field(default=src.default, title=title, description=src.description, **constraints)


def _kube(name: str, title: str):
    """A block field with the default and description of ``KubernetesSpec.<name>`` (checked by it)."""
    src = KubernetesSpec.model_fields[name]
    default = {"default_factory": src.default_factory} if src.default_factory else {"default": src.default}
    return Field(title=title, description=src.description, **default)


class _ElasticJob(Block, ABC):
    """The elastic job settings every cluster kind shares (not a block type itself)."""

    workers_per_node: int = _mirror("workers_per_node", "Workers per node", ge=1)
    nodes_min: int = _mirror("nodes_min", "Minimum nodes", ge=1)
    nodes_max: int = _mirror("nodes_max", "Maximum nodes", ge=1)
    spare_nodes: int = _mirror("spare_nodes", "Standby nodes", ge=0)
    node_timeout_s: int = _mirror("node_timeout_s", "Lost-node timeout (s)", ge=2, le=60)
    max_restarts: int = _mirror("max_restarts", "Maximum restarts", ge=0)
    spares_per_node: int = _mirror("spares_per_node", "Warm spare workers per node", ge=0)
    backend: Literal["auto", "gloo", "nccl"] = _mirror("backend", "Collective backend")
    threads_per_worker: int = _mirror("threads_per_worker", "Threads per worker", ge=0)
    parallelism: Literal["ddp", "fsdp"] = _mirror("parallelism", "Parallelism")
    rejoin_after_s: float = _mirror("rejoin_after_s", "Re-check a lost node after (s)", ge=0)

    @model_validator(mode="after")
    def _valid_spec(self):
        ClusterSpec(**self._job_settings())  # cross-field rules (nodes_min <= nodes_max) live in ClusterSpec only
        return self

    def _job_settings(self) -> dict:
        return {name: getattr(self, name) for name in _ElasticJob.model_fields}

    def to_spec(self) -> ClusterSpec:
        raise NotImplementedError

    def spec_update(self, campaign_name: str) -> dict:
        """Spec settings this block decides: the ``cluster`` section."""
        return {"cluster": self.to_spec().model_dump(mode="json")}

    def environment(self) -> dict[str, str]:
        """No credentials: local processes need none, and the Kubernetes client reads its own
        (the kubeconfig, or the pod's service account in-cluster)."""
        return {}


class LocalProcessCluster(_ElasticJob):
    """Runs a stage's training job as local processes: one elastic agent per node, each with
    ``workers_per_node`` workers. Turns into the campaign spec's ``cluster`` section.

    Example:
        Use the stored cluster settings for a campaign:
        ```python
        from blocks import LocalProcessCluster
        from pretrain.spec.file import load_spec

        cluster = LocalProcessCluster.load("BLOCK_NAME")
        spec = load_spec("builtin:tiny").model_copy(update={"cluster": cluster.to_spec()})
        ```
    """

    _block_type_name = "Local Process Cluster"
    _block_type_slug = "local-process-cluster"
    _description = "Local torch elastic training processes: nodes, workers per node, restarts and backend."
    _documentation_url = "https://docs.pytorch.org/docs/stable/elastic/run.html"

    def to_spec(self) -> ClusterSpec:
        """The campaign spec's ``cluster`` section (``kind: local``)."""
        return ClusterSpec(kind="local", **self._job_settings())


class KubernetesCluster(_ElasticJob):
    """A Kubernetes cluster for training jobs: one pod per node, ``workers_per_node`` workers in
    each; the pod settings are the spec's ``cluster.kubernetes`` section. A campaign that refers to
    it runs each stage as an Indexed Job there (``pretrain cluster render`` prints the manifests
    without creating anything).

    Example:
        Inspect the stored cluster configuration:
        ```python
        from blocks import KubernetesCluster

        cluster = KubernetesCluster.load("BLOCK_NAME")
        print(cluster.namespace, cluster.image, cluster.nodes_max)
        ```
    """

    _block_type_name = "Kubernetes Training Cluster"
    _block_type_slug = "kubernetes-training-cluster"
    _description = (
        "Kubernetes settings for elastic pre-training jobs: namespace, image, pod resources, nodes and workers."
    )
    _documentation_url = "https://docs.prefect.io/integrations/prefect-kubernetes"

    namespace: str = _kube("namespace", "Namespace")
    image: str = _kube("image", "Image")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = _kube("image_pull_policy", "Image pull policy")
    image_pull_secrets: list[str] = _kube("image_pull_secrets", "Image pull secrets")
    service_account_name: str | None = _kube("service_account_name", "Service account")
    cpu_per_node: str = _kube("cpu_per_node", "CPU per node")
    memory_per_node: str = _kube("memory_per_node", "Memory per node")
    gpus_per_node: int = _kube("gpus_per_node", "GPUs per node")
    shm_size: str = _kube("shm_size", "Shared memory size")
    node_selector: dict[str, str] = _kube("node_selector", "Node selector")
    tolerations: list[Toleration] = _kube("tolerations", "Tolerations")
    unreachable_eviction_s: int = _kube("unreachable_eviction_s", "Eviction from an unreachable node (s)")
    node_silent_s: int = _kube("node_silent_s", "Silent node agent limit (s)")
    priority_class_name: str | None = _kube("priority_class_name", "Priority class")
    env: dict[str, str] = _kube("env", "Environment")
    secret_env: dict[str, SecretKeyRef] = _kube("secret_env", "Environment from Secrets")
    workdir_claim: str | None = _kube("workdir_claim", "Workdir volume claim")
    labels: dict[str, str] = _kube("labels", "Labels")
    annotations: dict[str, str] = _kube("annotations", "Annotations")
    ttl_seconds_after_finished: int | None = _kube("ttl_seconds_after_finished", "Finished job TTL (s)")
    rdzv_port: int = _kube("rdzv_port", "Rendezvous port")
    credentials: KubernetesCredentials | None = Field(
        default=None,
        title="Credentials",
        description="prefect-kubernetes credentials (a kube config); empty uses the in-cluster or local default "
        "config.",
    )

    @model_validator(mode="after")
    def _valid_pods(self):
        self._kube_spec()  # the pod rules (names, quantities, no secrets in env) live in KubernetesSpec only
        return self

    def _kube_spec(self) -> KubernetesSpec:
        return KubernetesSpec(**{name: getattr(self, name) for name in KubernetesSpec.model_fields})

    def to_spec(self) -> ClusterSpec:
        """The campaign spec's ``cluster`` section (``kind: kubernetes``): its stages run as Indexed
        Jobs (``pretrain.cluster.kube``); ``pretrain cluster render`` prints them for review."""
        return ClusterSpec(kind="kubernetes", kubernetes=self._kube_spec(), **self._job_settings())
