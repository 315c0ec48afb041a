"""The ``cluster`` section of a campaign spec: where the workers run, how many, and how a job
recovers from a lost worker or node (its ``kubernetes`` settings in :mod:`pretrain.spec.kube`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pretrain.spec.base import Section
from pretrain.spec.kube import KubernetesSpec


class ClusterSpec(Section):
    kind: Literal["local", "kubernetes"] = Field(
        "local",
        description="Where workers run: 'local' processes, or 'kubernetes' (one pod per node, settings in "
        "`kubernetes`; `pretrain cluster render` shows the manifests; the flow reaches the API through KUBECONFIG or "
        "its pod's service account).",
    )
    workers_per_node: int = Field(
        2, ge=1, description="Training processes per node (one per accelerator; on CPU one per core is sensible)."
    )
    nodes_min: int = Field(1, ge=1, description="Fewest nodes the job may run with (elastic lower bound).")
    nodes_max: int = Field(1, ge=1, description="Most nodes the job starts with (elastic upper bound).")
    spare_nodes: int = Field(
        0,
        ge=0,
        description="Standby nodes of a job of several nodes (on Kubernetes: standby pods of the Job, indices "
        "nodes_max and up): their agents start once training is under way and wait in the rendezvous, torch imported; "
        "when a node is lost one takes its place at once, so the world keeps its size and global batch (no shrink, no "
        "scale-up later). The cluster has nodes_max + spare_nodes nodes; the node check covers them all.",
    )
    node_timeout_s: int = Field(
        3,
        ge=2,
        le=60,
        description="A node of a job of several nodes whose agent sent no keep-alive (one a second) for "
        "this long counts as lost and leaves the rendezvous; the other nodes wait that long before going on without it "
        "(or with a spare node). Lower is faster recovery; too low drops a node that is only slow (an agent starved of "
        "CPU for about a second at 2; with spare_nodes a standby then takes its place: a restart of the job).",
    )
    max_restarts: int = Field(
        2, ge=0, description="In-job restarts by the elastic agent before the job counts as failed."
    )
    spares_per_node: int = Field(
        1,
        ge=0,
        description="Warm spare workers per node: started once training is under way, with torch imported "
        "and the model built; when a worker dies the others keep running (on every node) and a spare of its node takes "
        "its rank (docs/recovery.md). On a job of several nodes a full restart or a new rendezvous round starts the "
        "node's spares anew. 0: the lost worker is replaced by a cold start, the others still kept.",
    )
    rejoin_after_s: float = Field(
        60.0,
        ge=0,
        description="A node lost during a job is health-checked again after this many seconds; if it passes, "
        "the job is stopped (the savers persist the newest snapshot) and relaunched on all nodes — the cluster scales "
        "back up with the same global batch and exact data position. 0: keep the smaller world until the job ends.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend: 'auto' picks NCCL on GPU, gloo on CPU."
    )
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="Data parallelism: 'ddp' replicates model and optimizer on every worker (rank 0 checkpoints "
        "them); 'fsdp' shards them across the workers with FSDP2 (per block + root), and every worker checkpoints its "
        "own shard. Checkpoints of either kind can start or resume a stage of the other (docs/fault-tolerance.md).",
    )
    threads_per_worker: int = Field(
        0, ge=0, description="torch threads per worker; 0 divides the machine's cores among workers."
    )
    kubernetes: KubernetesSpec | None = Field(
        None,
        description="Pods of a 'kubernetes' cluster: namespace, image, resources, scheduling, secrets by reference.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> ClusterSpec:
        if self.nodes_min > self.nodes_max:
            raise ValueError(f"nodes_min ({self.nodes_min}) must not exceed nodes_max ({self.nodes_max})")
        if self.spare_nodes and self.nodes_max < 2:
            raise ValueError(
                "spare_nodes stand by for a job of several nodes: set nodes_max to 2 or more (a job of "
                "one node recovers a lost worker with spares_per_node)"
            )
        return self

    @property
    def node_count(self) -> int:
        """Nodes of the cluster: the job's (``nodes_max``) and its standby nodes."""
        return self.nodes_max + self.spare_nodes

    def nodes_in_use(self, excluded: int = 0) -> int:
        """Nodes a job trains on when ``excluded`` nodes failed the node check (standby nodes fill in first)."""
        return min(self.nodes_max, self.node_count - excluded)

    @model_validator(mode="after")
    def _kind_settings(self) -> ClusterSpec:
        if self.kind == "kubernetes" and self.kubernetes is None:
            raise ValueError("kind 'kubernetes' needs a `kubernetes` section (at least `image`)")
        if self.kind != "kubernetes" and self.kubernetes is not None:
            raise ValueError(f"the `kubernetes` section only applies to kind 'kubernetes' (kind is {self.kind!r})")
        return self
