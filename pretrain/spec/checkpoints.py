"""The ``checkpoint`` section of a campaign spec (how often, where and how many checkpoints are
kept, and where the campaign's state lives) and the ``validation`` section (the gate that judges
each checkpoint, and its evaluations)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from pretrain.spec.base import Section
from pretrain.spec.uris import S3_CREDENTIALS_GO, no_credentials_in_url


class CheckpointSpec(Section):
    interval: int = Field(
        20,
        gt=0,
        description="Persist a checkpoint to storage every this many steps (and always at a stage's last step).",
    )
    memory_interval: int = Field(
        5,
        ge=0,
        description="Flash checkpoints: snapshot the training state into shared memory every this many steps "
        "(training blocks only for the copy; the node's saver persists every `interval` steps). 0 writes checkpoints "
        "straight to storage instead.",
    )
    keep: int = Field(
        3,
        ge=1,
        description="Committed checkpoints kept per stage (older ones are deleted; the latest and the good one never "
        "are).",
    )
    shm_dir: str = Field("/dev/shm", description="Directory on a memory filesystem for the snapshot buffers.")
    shm_fallback: bool = Field(
        False, description="If shared memory is too small for the snapshots, persist directly instead of failing."
    )
    uri: str | None = Field(
        None,
        description="Where checkpoints are stored: empty → <workdir>/checkpoints; or 's3://bucket/prefix'. S3 "
        "credentials come from the standard AWS environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, a "
        "role), never from the spec.",
    )
    s3_endpoint_url: str | None = Field(
        None, description="Endpoint of an S3-compatible server (MinIO, SeaweedFS, …); empty → AWS."
    )
    s3_region: str | None = Field(None, description="S3 region; empty → the AWS environment's default.")
    state_uri: str | None = Field(
        None,
        description="Where the campaign's state (ledger, lease) lives: empty → the workdir, and a file lock keeps "
        "two runs apart on this machine; or shared storage ('s3://bucket/prefix', same endpoint and credentials as "
        "the checkpoints, or a shared directory), where a lease keeps two runs apart wherever they run.",
    )

    @field_validator("uri", "s3_endpoint_url", "state_uri")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return no_credentials_in_url(url, S3_CREDENTIALS_GO)

    @model_validator(mode="after")
    def _s3_only_options(self) -> CheckpointSpec:
        if (self.s3_endpoint_url or self.s3_region) and not any(
            (u or "").startswith("s3://") for u in (self.uri, self.state_uri)
        ):
            raise ValueError("s3_endpoint_url / s3_region only apply when uri or state_uri is an s3:// URL")
        return self

    @model_validator(mode="after")
    def _persist_on_snapshots(self) -> CheckpointSpec:
        if self.memory_interval and self.interval % self.memory_interval:
            raise ValueError(
                f"interval ({self.interval}) must be a multiple of memory_interval ({self.memory_interval}): "
                "checkpoints are persisted from memory snapshots"
            )
        return self


class ValidationSpec(Section):
    probe_windows: int = Field(
        16,
        ge=1,
        description="Held-out sequences (the first of the validation split, the same for every checkpoint) in the "
        "gate's probe loss.",
    )
    probe_tolerance: float = Field(
        0.5,
        gt=0,
        description="A checkpoint whose probe loss exceeds the training loss recorded at its step by more than this "
        "fraction is bad (diverged or damaged weights).",
    )
    eval_every: int = Field(
        1,
        ge=0,
        description="Evaluate every Nth good checkpoint during training (val loss, perplexity, accuracy → MLflow at "
        "its step); 0: only each stage's final one.",
    )
    eval_batches: int = Field(16, ge=1, description="Validation batches (of 8 sequences) per evaluation.")
