"""Where a chaos drill's firing is recorded: one marker file per drill and stage, created with O_EXCL in
the stage's ``chaos/`` directory, so a restarted worker, a relaunched job or another process does not fire
it again (``trainer.resilience.chaos`` fires the drills)."""

from __future__ import annotations

import os
from pathlib import Path

from trainer.job.layout import JobLayout


def marker_dir(job_dir: str | Path) -> Path:
    return JobLayout.of(job_dir).chaos


def claim(job_dir: str | Path, index: int) -> bool:
    """True exactly once per drill and stage, whoever asks (workers, restarts, agents)."""
    d = marker_dir(job_dir)
    d.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(d / f"drill_{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def claimed(job_dir: str | Path, index: int) -> bool:
    """Whether drill ``index`` has fired in this stage."""
    return (marker_dir(job_dir) / f"drill_{index}").exists()


def reached_marker(job_dir: str | Path, index: int) -> Path:
    """Created by a worker of an agent-side drill's node when it is at the drill's step: it waits
    there until the agent has fired the drill, so the drill happens at exactly that step however
    late the agent's watcher looks (a loaded machine)."""
    return marker_dir(job_dir) / f"reached_{index}"
