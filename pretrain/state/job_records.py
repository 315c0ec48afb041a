"""The jobs' records of a campaign whose state is on shared storage (``checkpoint.state_uri``).

Each launch of a stage's job writes its records in the workdir (``jobs/<stage>/attempt_NNN/``:
its events, its metrics, its node agents' logs): the goodput split, the incidents' detail and a
person reading what happened use them. The ledger and the checkpoints of such a campaign
survive the loss of its orchestrator's disk; these records are copied next to the ledger after
every job (``jobs/…`` under ``state_uri``), each file whose copy is missing or of another size,
so a run that failed to copy (storage away) is caught up by the next. A run in a workdir that
lacks them (another machine, a lost disk) restores them before it starts.

A file there that is not a job record's name is ignored, never written into the workdir.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from trainer.job.reporting import EVENTS, METRICS
from trainer.storage import NotFound, Storage

PREFIX = "jobs/"
# jobs/<stage>/attempt_NNN/<events, metrics or a node agent's log>; stage names are the spec's (no '/')
KEY = re.compile(rf"^jobs/(?!\.)[^/]+/attempt_\d{{3}}/({re.escape(EVENTS)}|{re.escape(METRICS)}|node\d+\.log)$")


@dataclass
class Copied:
    """What a sync moved: file keys; ``failed``: ``(key, why)`` of the files it could not move."""

    files: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


def local_records(workdir: Path) -> dict[str, Path]:
    """The workdir's job record files by their key (``jobs/<stage>/attempt_NNN/<name>``)."""
    found = {}
    for path in sorted((workdir / "jobs").glob("*/attempt_*/*")):
        key = path.relative_to(workdir).as_posix()
        if KEY.match(key) and path.is_file():
            found[key] = path
    return found


def keep_records(storage: Storage, workdir: Path) -> Copied:
    """Copy every job record of ``workdir`` whose copy in ``storage`` is missing or of another
    size (records only grow; a job's files are complete once it ended)."""
    done = Copied()
    remote = _sizes(storage)
    for key, path in local_records(workdir).items():
        try:
            if key in remote and (remote[key] if remote[key] is not None else storage.size(key)) == path.stat().st_size:
                continue
            storage.put_file(key, path)
            done.files.append(key)
        except (OSError, RuntimeError) as err:  # StorageError is a RuntimeError; a file removed meanwhile: OSError
            done.failed.append((key, str(err) or type(err).__name__))
    return done


def _sizes(storage: Storage) -> dict[str, int | None]:
    """The job records in ``storage`` with their sizes where its listing gives them (S3: one
    listing instead of a request per file), else None."""
    listing = getattr(storage, "list_objects", None)
    if listing is not None:
        return {o.key: o.size for o in listing(PREFIX)}
    return dict.fromkeys(storage.list(PREFIX))


def restore_records(storage: Storage, workdir: Path) -> Copied:
    """Copy into ``workdir`` every job record of ``storage`` it lacks (a file it has is kept:
    it is the newer or the same)."""
    done = Copied()
    for key in sorted(storage.list(PREFIX)):
        path = workdir / key
        if not KEY.match(key) or path.exists():
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            storage.get_file(key, path)
            done.files.append(key)
        except NotFound:
            continue  # deleted meanwhile
        except (OSError, RuntimeError) as err:
            done.failed.append((key, str(err) or type(err).__name__))
    return done
