"""Block: a cluster of local worker processes (torch elastic agents on this machine)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from prefect.blocks.core import Block

from pretrain.spec import ClusterSpec

_SPEC_FIELDS = ClusterSpec.model_fields


def _mirror(name: str, title: str, **constraints: int):
    """A block field with the default and description of ``ClusterSpec.<name>`` (one source of truth)."""
    src = _SPEC_FIELDS[name]
    return Field(default=src.default, title=title, description=src.description, **constraints)


class LocalProcessCluster(Block):
    """Runs a stage's training job as local processes: one elastic agent per node, each with
    ``workers_per_node`` workers. Turns into the campaign spec's ``cluster`` section.

    Example:
        Use the stored cluster settings for a campaign:
        ```python
        from blocks import LocalProcessCluster
        from pretrain.spec import load_spec

        cluster = LocalProcessCluster.load("BLOCK_NAME")
        spec = load_spec("builtin:tiny").model_copy(update={"cluster": cluster.to_spec()})
        ```
    """

    _block_type_name = "Local Process Cluster"
    _block_type_slug = "local-process-cluster"
    _description = "Local torch elastic training processes: nodes, workers per node, restarts and backend."
    _documentation_url = "https://docs.pytorch.org/docs/stable/elastic/run.html"

    workers_per_node: int = _mirror("workers_per_node", "Workers per node", ge=1)
    nodes_min: int = _mirror("nodes_min", "Minimum nodes", ge=1)
    nodes_max: int = _mirror("nodes_max", "Maximum nodes", ge=1)
    max_restarts: int = _mirror("max_restarts", "Maximum restarts", ge=0)
    backend: Literal["auto", "gloo", "nccl"] = _mirror("backend", "Collective backend")
    threads_per_worker: int = _mirror("threads_per_worker", "Threads per worker", ge=0)

    @model_validator(mode="after")
    def _valid_spec(self) -> "LocalProcessCluster":
        self.to_spec()  # cross-field rules (nodes_min <= nodes_max) live in ClusterSpec only
        return self

    def to_spec(self) -> ClusterSpec:
        """The campaign spec's ``cluster`` section (``kind: local``)."""
        return ClusterSpec(kind="local", **{name: getattr(self, name) for name in type(self).model_fields})
