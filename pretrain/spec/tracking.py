"""The ``tracking`` section of a campaign spec: the MLflow store, experiment and model registry."""

from __future__ import annotations

from pydantic import Field, field_validator

from pretrain.spec.base import Section
from pretrain.spec.uris import MLFLOW_CREDENTIALS_GO, no_credentials_in_url


class TrackingSpec(Section):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI; default: MLFLOW_TRACKING_URI, else 'sqlite:///<cwd>/mlflow.db' (one store "
        "shared by the campaigns run from a directory; a workdir with its own mlflow.db keeps it). Recorded in the "
        "ledger: a resumed campaign uses the store it started with.",
    )
    experiment: str = Field("pretrain", min_length=1, description="MLflow experiment name.")
    log_every: int = Field(1, gt=0, description="Log training metrics every this many steps.")
    register_model: bool = Field(
        True,
        description="When the campaign completes, export its final good checkpoint (Hugging Face GPT-2 layout), log "
        "it as a model of the campaign's MLflow run with its eval metrics and register it in the model registry "
        "(MLflow's transformers flavor).",
    )
    registered_model: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Registered model name in the MLflow model registry (letters, digits, '_', '.', '-'); empty → "
        "the campaign name.",
    )
    model_alias: str = Field(
        "latest-good",
        pattern=r"^[A-Za-z][A-Za-z0-9_-]*$",
        description="Registry alias moved to each newly registered version: load it as models:/<name>@<alias>.",
    )
    registration_wait_s: float = Field(
        120,
        ge=0,
        description="How long the end of a campaign retries registering the final model while MLflow does "
        "not answer (tries after 2, 10, 30 and 60 s, as many as fit). Past it the campaign completes anyway with the "
        "registration pending (`pretrain status` says so) and its next run registers the model, training nothing "
        "again.",
    )

    @field_validator("uri")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return no_credentials_in_url(url, MLFLOW_CREDENTIALS_GO)

    @field_validator("model_alias")
    @classmethod
    def _alias_not_reserved(cls, alias: str) -> str:
        if alias.lower() == "latest" or (alias[0] in "vV" and alias[1:].isdigit()):
            raise ValueError(f"{alias!r} is reserved by MLflow ('latest', 'v<number>'): choose another alias")
        return alias
