"""Block: where campaigns keep their working directories on a local (or shared) filesystem."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from prefect.blocks.core import Block


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

    root: Path = Field(
        default=Path("./runs"),
        title="Root directory",
        description="Directory where campaigns keep their workdirs, one sub-directory per campaign; "
        "'~' expands and a relative path is resolved against the current directory when used.",
    )

    def workdir_for(self, campaign_name: str) -> Path:
        """Absolute workdir of ``campaign_name``: ``<root>/<campaign_name>``.

        The name must be a single path component, so a campaign cannot escape the root.
        """
        if not campaign_name or campaign_name in {".", ".."} or Path(campaign_name).name != campaign_name:
            raise ValueError(f"campaign name {campaign_name!r} must be a single path component (no '/', not '.' or '..')")
        return Path(self.root).expanduser().resolve() / campaign_name
