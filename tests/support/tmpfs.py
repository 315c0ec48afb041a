"""A small tmpfs mounted by a test: a real file system that fills up (ENOSPC) at a known size.

Mounting needs root (sessions and CI run as root); elsewhere the test is skipped, saying why.
"""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@contextmanager
def small_tmpfs(path: Path, size: str):
    """Mount a tmpfs of ``size`` (mount's syntax: "2m", "512k") at ``path``; unmount on exit."""
    path.mkdir(parents=True, exist_ok=True)
    done = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def resize_tmpfs(path: Path, size: str) -> None:
    """Grow (or shrink) a mounted tmpfs: the operator freeing space."""
    done = _mount("-o", f"remount,size={size}", str(path))
    assert done.returncode == 0, done.stderr
