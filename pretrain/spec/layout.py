"""Where a campaign keeps each piece of its state inside its workdir (one place to look)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class UnusableWorkdir(ValueError):
    """The campaign's workdir cannot be made or written; the message says why and what to give."""


def a_file_in_the_way(path: Path) -> str:
    """Says which file stands where the directory ``path`` (or one of its parents) should be."""
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
    return f"{blocking} is a file, not a directory"


def ensure_workdir(path: Path) -> None:
    """Make the campaign's workdir (and its parents) if it is missing; raise
    :class:`UnusableWorkdir` if it cannot hold the campaign's state, before anything starts."""
    what = "give a directory you can write to (--workdir DIR, or the spec's workdir)"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UnusableWorkdir(f"{a_file_in_the_way(path)}: {what}") from None
    except OSError as err:
        raise UnusableWorkdir(f"cannot make the workdir {path}: {err.strerror or err}; {what}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UnusableWorkdir(f"cannot write in the workdir {path} (permission denied): {what}")


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
        """The node-local copies of data sets kept on S3 (``trainer.data.cache``)."""
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
