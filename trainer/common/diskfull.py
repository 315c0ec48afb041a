"""Disk full (ENOSPC): recognise it wherever it is raised from (an OSError, or wrapped by a
library such as torch.save), and say which file system is full, how much is needed and what
to change."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


def is_disk_full(err: BaseException | None) -> bool:
    """Is ``err`` (or what caused it) "no space left on device" (or a quota exceeded)?"""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err):  # e.g. torch.save's writer re-raises it as RuntimeError
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _existing(path: str | Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def filesystem_of(path: str | Path) -> str:
    """``<mount point> (<type> <device>)`` of the file system holding ``path``."""
    p = _existing(path)
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    mounts = {}
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            mounts[mount] = f"{mount} ({kind} {device})"
    except (OSError, ValueError):
        pass
    return mounts.get(str(p), str(p))


def free_bytes(path: str | Path) -> int | None:
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return None


def describe(path: str | Path, need: int, what: str, fix: str) -> str:
    """One message: what could not be written, where, the bytes needed and free, what to do."""
    free = free_bytes(path)
    have = "" if free is None else f", {free / 2**20:.1f} MiB free"
    return (
        f"no space left on {filesystem_of(path)} for {what} in {path}: needs about {need / 2**20:.1f} MiB{have}. {fix}"
    )
