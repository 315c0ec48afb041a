"""Prefect blocks of prefect-pretrain (registered with ``prefect block register -m blocks``; the
``prefect.collections`` entry point makes Prefect import them too)."""

from blocks.cluster import KubernetesCluster, LocalProcessCluster
from blocks.storage import LocalCampaignStorage, S3CampaignStorage
from blocks.tracking import MlflowTracking

__all__ = ["KubernetesCluster", "LocalCampaignStorage", "LocalProcessCluster", "MlflowTracking", "S3CampaignStorage"]
