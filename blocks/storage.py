"""Blocks: where campaigns keep their state — a local (or shared) directory, or S3 for checkpoints.

Both storage blocks answer the same three questions for a campaign name: its workdir
(``workdir_for``), the spec settings they replace (``spec_update``) and the environment the
training processes need (``environment``: credentials, never written to the spec or the ledger).
"""

from __future__ import annotations

from pathlib import Path

from prefect.blocks.core import Block
from prefect_aws import AwsCredentials, MinIOCredentials
from pydantic import Field, SecretStr, field_validator

from pretrain.spec.uris import S3_CREDENTIALS_GO, no_credentials_in_url

_ROOT_DESCRIPTION = (
    "Directory where campaigns keep their workdirs, one sub-directory per campaign; '~' expands and a "
    "relative path is resolved against the current directory when used."
)


def _workdir(root: Path, campaign_name: str) -> Path:
    """``<root>/<campaign_name>``; the name must be a single path component, so a campaign cannot escape the root."""
    if not campaign_name or campaign_name in {".", ".."} or Path(campaign_name).name != campaign_name:
        raise ValueError(f"campaign name {campaign_name!r} must be a single path component (no '/', not '.' or '..')")
    return Path(root).expanduser().resolve() / campaign_name


class LocalCampaignStorage(Block):
    """A directory on this machine (or a shared mount) that holds one workdir per campaign.

    A campaign's workdir holds everything it needs to resume: data manifest, checkpoints,
    ledger and the default MLflow database. ``workdir_for(name)`` is ``<root>/<name>``.

    Example:
        Put a campaign's state under the stored root:
        ```python
        from blocks import LocalCampaignStorage
        from flows.campaign import pretrain_campaign

        storage = LocalCampaignStorage.load("BLOCK_NAME")
        pretrain_campaign(spec_path="builtin:tiny", workdir=str(storage.workdir_for("tiny")))
        ```
    """

    _block_type_name = "Local Campaign Storage"
    _block_type_slug = "local-campaign-storage"
    _description = "A local or shared directory that holds one working directory per pre-training campaign."
    _documentation_url = "https://docs.prefect.io/v3/concepts/blocks"

    root: Path = Field(default=Path("./runs"), title="Root directory", description=_ROOT_DESCRIPTION)

    def workdir_for(self, campaign_name: str) -> Path:
        """Absolute workdir of ``campaign_name``: ``<root>/<campaign_name>``."""
        return _workdir(self.root, campaign_name)

    def spec_update(self, campaign_name: str) -> dict:
        """Spec settings this block decides: the workdir (checkpoints stay inside it)."""
        return {"workdir": str(self.workdir_for(campaign_name))}

    def environment(self) -> dict[str, str]:
        """Nothing: local directories need no credentials."""
        return {}


class S3CampaignStorage(Block):
    """Checkpoints on S3 (or an S3-compatible server such as MinIO or SeaweedFS), the rest of a
    campaign's state (ledger, data, MLflow database) in a local workdir.

    Credentials are a saved ``AwsCredentials`` or ``MinIOCredentials`` block of prefect-aws; the
    endpoint and region come from it too. The campaign flow hands them to its training
    processes as the standard ``AWS_*`` environment variables of those processes alone (``env=``,
    never this process's environment) and to S3 clients of the flow as arguments — never through
    the spec, the ledger or a job file. Credentials that name no keys let boto3 find them in each
    process (environment, profile, instance or IRSA role).

    A campaign spec uses it with ``blocks: {storage: s3-campaign-storage/<name>}``.

    Example:
        See where a campaign's checkpoints go:
        ```python
        from blocks import S3CampaignStorage

        storage = S3CampaignStorage.load("BLOCK_NAME")
        print(storage.checkpoint_uri("tiny"), storage.workdir_for("tiny"))
        ```
    """

    _block_type_name = "S3 Campaign Storage"
    _block_type_slug = "s3-campaign-storage"
    _description = (
        "Pre-training checkpoints in an S3 bucket (AWS, MinIO, SeaweedFS, ...) with prefect-aws credentials; "
        "ledger and data in a local workdir."
    )
    _documentation_url = "https://docs.prefect.io/integrations/prefect-aws"

    bucket_name: str = Field(
        default=..., min_length=3, title="Bucket", description="Bucket that holds the checkpoints."
    )
    prefix: str = Field(
        default="campaigns",
        title="Key prefix",
        description="Key prefix inside the bucket; a campaign's checkpoints go to "
        "s3://<bucket>/<prefix>/<campaign>/<stage>/.",
    )
    credentials: AwsCredentials | MinIOCredentials = Field(
        default_factory=AwsCredentials,
        title="Credentials",
        description="prefect-aws credentials block; its region and client endpoint URL (MinIO, SeaweedFS) are used "
        "too.",
    )
    root: Path = Field(default=Path("./runs"), title="Local root directory", description=_ROOT_DESCRIPTION)

    @field_validator("credentials")
    @classmethod
    def _credentials_usable_by_every_process(cls, credentials):
        no_credentials_in_url(credentials.aws_client_parameters.endpoint_url, S3_CREDENTIALS_GO)
        if getattr(credentials, "assume_role_arn", None):
            raise ValueError(
                "assume_role_arn is not supported: keys assumed here would expire inside long training "
                "jobs. Use an AWS profile with role_arn (profile_name), or the role of the machine or "
                "pod (IRSA): then every process's boto3 assumes and refreshes the role itself"
            )
        return credentials

    def workdir_for(self, campaign_name: str) -> Path:
        """Absolute local workdir of ``campaign_name`` (ledger, data, MLflow database)."""
        return _workdir(self.root, campaign_name)

    def checkpoint_uri(self, campaign_name: str) -> str:
        _workdir(Path("/"), campaign_name)  # same name rule as the workdir
        key = "/".join(p for p in (self.prefix.strip("/"), campaign_name) if p)
        return f"s3://{self.bucket_name}/{key}"

    def spec_update(self, campaign_name: str) -> dict:
        """Spec settings this block decides: the workdir and the checkpoint location, endpoint and region."""
        params = self.credentials.aws_client_parameters
        return {
            "workdir": str(self.workdir_for(campaign_name)),
            "checkpoint": {
                "uri": self.checkpoint_uri(campaign_name),
                "s3_endpoint_url": params.endpoint_url or None,
                "s3_region": self.credentials.region_name or None,
            },
        }

    def environment(self) -> dict[str, str]:
        """The credentials the block names, as standard ``AWS_*`` variables (keys, session token,
        profile, region). Nothing is resolved or frozen here: a block that names no keys gives none,
        and each process's boto3 finds its own (environment, profile, instance or IRSA role) and
        refreshes temporary ones itself."""
        c = self.credentials
        if isinstance(c, MinIOCredentials):
            pairs = [("AWS_ACCESS_KEY_ID", c.minio_root_user), ("AWS_SECRET_ACCESS_KEY", c.minio_root_password)]
        else:
            pairs = [
                ("AWS_ACCESS_KEY_ID", c.aws_access_key_id),
                ("AWS_SECRET_ACCESS_KEY", c.aws_secret_access_key),
                ("AWS_SESSION_TOKEN", c.aws_session_token),
                ("AWS_PROFILE", c.profile_name),
            ]
        pairs.append(("AWS_DEFAULT_REGION", c.region_name))
        return {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in pairs if v}
