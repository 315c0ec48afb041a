"""The ``blocks`` section of a campaign spec: saved Prefect blocks it refers to by name."""

from __future__ import annotations

from pydantic import Field

from pretrain.spec.base import Section


class BlockRefs(Section):
    """Saved Prefect blocks a spec refers to by name instead of inline settings (resolved by the
    campaign flow; the core never talks to Prefect)."""

    storage: str | None = Field(
        None,
        description="Campaign storage block as '<block-type-slug>/<name>', e.g. 'local-campaign-storage/shared' or "
        "'s3-campaign-storage/prod': decides the workdir (and, for S3, where checkpoints go and their credentials). "
        "Replaces `workdir` and `checkpoint.uri` / `s3_*`.",
    )
    cluster: str | None = Field(
        None,
        description="Cluster block as '<block-type-slug>/<name>', e.g. 'local-process-cluster/two-workers'. "
        "Replaces the `cluster` section.",
    )
    tracking: str | None = Field(
        None,
        description="MLflow tracking block as '<block-type-slug>/<name>', e.g. 'mlflow-tracking/team'. Replaces "
        "`tracking.uri` and `tracking.experiment` (a token stays in the block).",
    )

    def any(self) -> bool:
        return any((self.storage, self.cluster, self.tracking))
