"""Where a campaign keeps each piece of its state inside its workdir (one place to look)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CampaignLayout:
    root: Path

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.json"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def data_work(self) -> Path:
        """Data preparation's staging area and finished-unit cache (never a data set itself)."""
        return self.data_dir / ".work"

    @property
    def data_cache(self) -> Path:
        """The node-local copies of data sets kept on S3 (``trainer.data_cache``)."""
        return self.root / "cache" / "data"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

    def ckpt_dir(self, stage: str) -> Path:
        return self.root / "checkpoints" / stage

    def job_dir(self, stage: str, attempt: int) -> Path:
        return self.root / "jobs" / stage / f"attempt_{attempt:03d}"

    def stage_lock(self, stage: str, node: int) -> Path:
        return self.root / "jobs" / stage / f".node{node}.lock"
