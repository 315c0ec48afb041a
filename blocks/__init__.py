"""Prefect blocks of prefect-pretrain (registered with ``prefect block register -m blocks``)."""

from blocks.cluster import LocalProcessCluster
from blocks.storage import LocalCampaignStorage
from blocks.tracking import MlflowTracking

__all__ = ["LocalCampaignStorage", "LocalProcessCluster", "MlflowTracking"]
