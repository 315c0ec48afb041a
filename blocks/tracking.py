"""Block: the MLflow tracking server (or local database) a campaign logs to."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

from pretrain.spec.tracking import TrackingSpec
from pretrain.spec.uris import MLFLOW_CREDENTIALS_GO, no_credentials_in_url


class MlflowTracking(Block):
    """Where a campaign's MLflow runs go: a tracking URI and an experiment, plus an optional
    bearer token for servers that need authentication. The token is stored encrypted by
    Prefect, shown masked, and only leaves the block through ``environment()``.

    Example:
        Track a campaign on a shared MLflow server:
        ```python
        from blocks import MlflowTracking
        from pretrain.spec.file import load_spec

        tracking = MlflowTracking.load("BLOCK_NAME")
        spec = load_spec("builtin:tiny").model_copy(update={"tracking": tracking.to_spec()})
        print(spec.tracking_uri, sorted(tracking.environment()))  # the token itself stays in the block
        ```
    """

    _block_type_name = "MLflow Tracking"
    _block_type_slug = "mlflow-tracking"
    _description = "MLflow tracking URI, experiment and optional token for a pre-training campaign."
    _documentation_url = "https://mlflow.org/docs/latest/ml/tracking/"

    tracking_uri: str | None = Field(
        default=None,
        title="Tracking URI",
        description="MLflow tracking URI (e.g. 'http://mlflow:5000'); empty means MLFLOW_TRACKING_URI, else "
        "'mlflow.db' in the directory the campaign is first run from (shared by the campaigns run there).",
    )
    experiment: str = Field(
        default=TrackingSpec.model_fields["experiment"].default,
        min_length=1,
        title="Experiment",
        description="MLflow experiment name the campaign's runs are logged under.",
    )
    token: SecretStr | None = Field(
        default=None,
        title="Token",
        description="Bearer token for MLflow servers that require authentication (MLFLOW_TRACKING_TOKEN).",
    )

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str | None) -> str | None:
        return no_credentials_in_url(uri, MLFLOW_CREDENTIALS_GO)

    def to_spec(self) -> TrackingSpec:
        """The campaign spec's ``tracking`` section (the token is not part of it)."""
        return TrackingSpec(uri=self.tracking_uri, experiment=self.experiment)

    def spec_update(self, campaign_name: str) -> dict:
        """Spec settings this block decides: the ``tracking`` section's URI and experiment."""
        return {"tracking": {"uri": self.tracking_uri, "experiment": self.experiment}}

    def environment(self) -> dict[str, str]:
        """Environment variables that authenticate MLflow clients; empty without a token."""
        return {"MLFLOW_TRACKING_TOKEN": self.token.get_secret_value()} if self.token else {}
