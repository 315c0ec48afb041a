"""Atomic, durable file writes: write to a temporary name, fsync, rename, fsync the directory.

A reader sees either the old file or the complete new one, never a torn write, even if the
writer is killed or the machine loses power between the steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_moving_aside(tmp: Path, path: Path) -> None:
    """``os.replace(tmp, path)``; a directory squatting on ``path`` (a hand-made mess, never one of
    ours) is first renamed to ``<name>.not-a-file-<time>`` beside it: kept, never deleted."""
    try:
        os.replace(tmp, path)
    except IsADirectoryError:
        move_aside(path)
        os.replace(tmp, path)


def move_aside(path: Path) -> Path:
    """Rename the directory at ``path`` (where a file belongs) to ``<name>.not-a-file-<time>``."""
    aside = path.with_name(f"{path.name}.not-a-file-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    os.rename(path, aside)
    log.warning("%s was a directory where a file belongs: moved it to %s", path, aside.name)
    return aside


def atomic_write_bytes(path: str | Path, data: bytes) -> str:
    """Durably replace ``path`` with ``data``; returns the sha256 hex digest of ``data``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        replace_moving_aside(tmp, path)
    finally:  # a failed write (disk full, I/O error) leaves no temporary behind
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


def atomic_write_json(path: str | Path, obj: object, sort_keys: bool = True) -> str:
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n").encode())


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
