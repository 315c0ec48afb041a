"""Disk full (ENOSPC) on a real, small tmpfs: no torn file, the previous state stays good, a
clear message naming the file system, the bytes needed and the setting to change."""

from __future__ import annotations

import errno

import pytest

from tmpfs import small_tmpfs
from trainer.atomic import atomic_write_bytes


def test_atomic_write_that_fills_the_disk_leaves_the_old_file_and_no_temporary(tmp_path):
    with small_tmpfs(tmp_path / "fs", "1m") as fs:
        target = fs / "latest"
        atomic_write_bytes(target, b'{"step": 4}')
        with pytest.raises(OSError) as err:
            atomic_write_bytes(target, b"x" * (2 << 20))
        assert err.value.errno == errno.ENOSPC
        assert target.read_bytes() == b'{"step": 4}'
        assert sorted(p.name for p in fs.iterdir()) == ["latest"]  # no .latest.tmp-<pid> left
