"""Blocks: where a stage's training job runs — local processes, or (configuration only, for now)
a Kubernetes cluster."""

from __future__ import annotations

from abc import ABC
from typing import Literal, Optional

from pydantic import Field, model_validator
from prefect.blocks.core import Block
from prefect_kubernetes.credentials import KubernetesCredentials

from pretrain.spec_sections import ClusterSpec

_SPEC_FIELDS = ClusterSpec.model_fields


class ClusterNotSupported(ValueError):
    """The cluster block describes a cluster this version cannot run jobs on yet."""


def _mirror(name: str, title: str, **constraints: int):
    """A block field with the default and description of ``ClusterSpec.<name>`` (one source of truth)."""
    src = _SPEC_FIELDS[name]
    return Field(default=src.default, title=title, description=src.description, **constraints)


class _ElasticJob(Block, ABC):
    """The elastic job settings every cluster kind shares (not a block type itself)."""

    workers_per_node: int = _mirror("workers_per_node", "Workers per node", ge=1)
    nodes_min: int = _mirror("nodes_min", "Minimum nodes", ge=1)
    nodes_max: int = _mirror("nodes_max", "Maximum nodes", ge=1)
    max_restarts: int = _mirror("max_restarts", "Maximum restarts", ge=0)
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
        """Nothing yet: local processes need no credentials."""
        return {}


class LocalProcessCluster(_ElasticJob):
    """Runs a stage's training job as local processes: one elastic agent per node, each with
    ``workers_per_node`` workers. Turns into the campaign spec's ``cluster`` section.

    Example:
        Use the stored cluster settings for a campaign:
        ```python
        from blocks import LocalProcessCluster
        from pretrain.specfile import load_spec

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
    each. This version stores the configuration only; running jobs on it comes in a later
    release, and a campaign that refers to it fails with a clear error before anything starts.

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
    _description = "Kubernetes settings for elastic pre-training jobs: namespace, image, pod resources, nodes and workers."
    _documentation_url = "https://docs.prefect.io/integrations/prefect-kubernetes"

    namespace: str = Field(default="default", min_length=1, title="Namespace",
                           description="Namespace the training pods run in.")
    image: str = Field(default=..., min_length=1, title="Image",
                       description="Container image with this project installed (torch, trainer package).")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        default="IfNotPresent", title="Image pull policy", description="Kubernetes image pull policy of the training pods.")
    service_account_name: Optional[str] = Field(
        default=None, title="Service account", description="Service account of the training pods; empty uses the namespace default.")
    cpu_per_node: str = Field(default="4", title="CPU per node",
                              description="CPU request and limit of each node's pod, in Kubernetes quantity syntax (e.g. '4', '3500m').")
    memory_per_node: str = Field(default="16Gi", title="Memory per node",
                                 description="Memory request and limit of each node's pod (e.g. '16Gi').")
    gpus_per_node: int = Field(default=0, ge=0, title="GPUs per node",
                               description="nvidia.com/gpu resources of each node's pod; 0 trains on CPU.")
    shm_size: str = Field(default="8Gi", title="Shared memory size",
                          description="Size of the memory-backed /dev/shm volume that holds flash checkpoint snapshots.")
    node_selector: dict[str, str] = Field(default_factory=dict, title="Node selector",
                                          description="Node labels the training pods must run on.")
    credentials: Optional[KubernetesCredentials] = Field(
        default=None, title="Credentials",
        description="prefect-kubernetes credentials (a kube config); empty uses the in-cluster or local default config.")

    def to_spec(self) -> ClusterSpec:
        raise ClusterNotSupported(
            f"cluster block {self._block_document_name or '(unsaved)'!r} is a Kubernetes cluster, which this version "
            "stores but cannot run training jobs on yet: refer to a local-process-cluster block instead")
