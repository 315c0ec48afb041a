"""The stages of a campaign spec (``stages``: what each trains, for how long, from which
checkpoint) and the windows of a stage's data order a campaign skips (``skip_samples``)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from pretrain.spec.base import Section
from pretrain.spec.uris import S3_CREDENTIALS_GO, no_credentials_in_url

MAX_STEPS = 99_999_999  # step directories are named with 8 digits (step_00000040)


class StageSpec(Section):
    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Stage name (letters, digits, '-', '_'); used in paths and MLflow.",
    )
    steps: int = Field(
        ...,
        gt=0,
        le=MAX_STEPS,
        description="Optimizer steps in this stage (below 10^8: step directories have 8 digits).",
    )
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr: float = Field(3e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps before cosine decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    micro_batch: int = Field(8, gt=0, description="Sequences per worker per forward/backward.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    seq_len: int = Field(128, ge=8, description="Tokens per training sequence.")
    mixture: dict[str, float] = Field(
        default_factory=dict,
        description="Data group → weight (any positive scale): the stage draws its samples from "
        "the groups in these proportions, exactly and resumably. Empty: the whole training split in one order.",
    )
    carry_optimizer: bool = Field(
        True,
        description="Start from the previous stage's optimizer state (AdamW moments); false resets it. The model "
        "weights always carry over.",
    )
    init_from: str | None = Field(
        None,
        description="Start this stage from this checkpoint (…/step_XXXXXXXX, a local directory or s3:// URL; "
        "another campaign's, e.g. to continue on a changed data set) instead of the previous stage's final one "
        "(the first stage: from scratch). Only until the stage has checkpoints of its own.",
    )

    @field_validator("init_from")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return no_credentials_in_url(url, S3_CREDENTIALS_GO)

    @model_validator(mode="after")
    def _lr_order(self) -> StageSpec:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


class SkipWindow(Section):
    stage: str = Field(..., description="Stage whose data order the window refers to.")
    start: int = Field(..., ge=0, description="First global sample position skipped.")
    end: int = Field(..., gt=0, description="First global sample position no longer skipped.")

    @model_validator(mode="after")
    def _ordered(self) -> SkipWindow:
        if self.end <= self.start:
            raise ValueError(f"end ({self.end}) must be greater than start ({self.start})")
        return self
