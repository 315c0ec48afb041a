"""Atomic, durable file writes: write to a temporary name, fsync, rename, fsync the directory.

A reader sees either the old file or the complete new one, never a torn write, even if the
writer is killed or the machine loses power between the steps.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        os.replace(tmp, path)
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
