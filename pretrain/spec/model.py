"""The ``model`` section of a campaign spec: the transformer's shape."""

from __future__ import annotations

from pydantic import Field, model_validator

from pretrain.spec.base import Section


class ModelSpec(Section):
    n_layer: int = Field(4, ge=1, description="Transformer blocks.")
    n_head: int = Field(4, ge=1, description="Attention heads per block.")
    d_model: int = Field(128, ge=8, description="Hidden size; must be divisible by n_head.")
    max_seq_len: int = Field(
        256, ge=8, description="Longest sequence the position table supports; every stage's seq_len must fit."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability (0 keeps runs bitwise reproducible).")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        return self
