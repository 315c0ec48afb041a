"""The rule every URI of a spec keeps: no credentials in it (the URI itself is recorded in the
ledger, MLflow and logs), and where the credentials of each kind of store come from instead."""

from __future__ import annotations

from pretrain.redact import url_credentials

S3_CREDENTIALS_GO = (
    "S3 credentials come from the AWS environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
    "an instance or IRSA role) or from an s3-campaign-storage block's credentials (stored as secrets)"
)
MLFLOW_CREDENTIALS_GO = (
    "MLflow credentials come from MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or "
    "MLFLOW_TRACKING_TOKEN in the environment, or from an mlflow-tracking block's token"
)


def no_credentials_in_url(url: str | None, where: str) -> str | None:
    """``url`` unchanged, or a ValueError saying that credentials do not belong in it and ``where`` they go."""
    found = url_credentials(url) if url else None
    if found:
        raise ValueError(
            f"must not contain credentials ({found}): {where}; the URI itself is recorded in the "
            "ledger, MLflow and logs"
        )
    return url
