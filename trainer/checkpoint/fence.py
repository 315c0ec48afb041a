"""Commit fencing: only the newest job of a stage commits checkpoints.

A saver orphaned by its agent (agent SIGKILLed, node lost) still persists a final snapshot on
its way out; by then the orchestrator may have started a newer job that commits its own
checkpoints to the same location. Each job's agents *claim* the location before training (a
small ``fence`` record naming the job, last writer wins), and a saver checks, immediately
before it persists and before it writes a manifest and the pointer, that the claim is still
its own; otherwise it writes nothing.
"""

from __future__ import annotations

import time

FENCE = "fence"


def claim(store, job: str) -> None:
    """Make ``job`` (its job directory: unique per attempt) the one that commits to ``store``."""
    store.write_json(FENCE, {"job": job, "time": time.time()})


def holder(store) -> str | None:
    """The job that last claimed ``store``; None if none did (or the record is unreadable, which
    blocks nobody: the next job's claim rewrites it)."""
    try:
        record = store.read_json(FENCE)
    except (ValueError, UnicodeDecodeError):
        return None
    return record.get("job") if isinstance(record, dict) and isinstance(record.get("job"), str) else None


def superseded(store, job: str | None) -> str | None:
    """The newer job that owns ``store`` if it is not ``job`` (None: ``job`` may commit)."""
    if job is None:
        return None
    owner = holder(store)
    return owner if owner is not None and owner != job else None
