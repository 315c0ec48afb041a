"""The local-directory storage backend (``file:///dir`` or a plain path)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from trainer.common.atomic import atomic_write_bytes, fsync_dir
from trainer.storage.base import (
    _TMP_MARK,
    MiB,
    NotAFile,
    NotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    _dir_prefix,
    _mkdirs,
    _write_local_atomic,
    check_key,
)


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalStorage(Storage):
    """A directory on a local (or mounted) file system.

    Conditional writes: the ETag of a local object is the sha256 of its contents. Every write
    here publishes a complete file by one rename, so one read sees one whole version and its hash
    names that version exactly (an mtime can be too coarse, an inode number can be reused).
    ``put_if_absent`` publishes with link(2), which fails when the name exists; ``put_if_match``
    compares and renames while it holds an ``flock`` on a hidden lock file beside the key, which
    every ``put_if_match`` of that key takes. (A plain ``put_bytes`` or ``delete`` takes no lock:
    keys written conditionally must only be written conditionally.)
    """

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    @staticmethod
    def _not_a_file(path: Path) -> NotAFile:
        return NotAFile(f"{path} is a directory, not a file")

    def _file(self, key: str) -> Path:
        path = self._path(key)
        if path.is_dir():
            raise self._not_a_file(path)
        if not path.is_file():
            raise NotFound(f"{self.url}: key {key!r} does not exist")
        return path

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        _mkdirs(path.parent)
        atomic_write_bytes(path, data)

    def put_file(self, key: str, path: str | Path) -> None:
        _write_local_atomic(self._path(key), lambda tmp: shutil.copyfile(path, tmp))

    def put_stream(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        def fill(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                write(f)

        _write_local_atomic(self._path(key), fill)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"{self.url}: key {key!r} does not exist") from None
        except IsADirectoryError:
            raise self._not_a_file(self._path(key)) from None

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.get_bytes(key)
        return data, _etag(data)

    def put_if_absent(self, key: str, data: bytes) -> str:
        path = self._path(key)
        try:
            _write_local_atomic(path, lambda tmp: tmp.write_bytes(data), publish=os.link)
        except FileExistsError:
            raise PreconditionFailed(f"{self.url}: key {key!r} already exists") from None
        except OSError as err:
            raise StorageError(
                f"cannot create {path} exclusively: {err.strerror or err}; conditional writes need "
                "a writable filesystem with hard links (a local disk or NFS)"
            ) from None
        return _etag(data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        path = self._path(key)
        with self._key_lock(path):
            try:
                current = path.read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise PreconditionFailed(f"{self.url}: key {key!r} is gone (expected version {etag})") from None
            if _etag(current) != etag:
                raise PreconditionFailed(f"{self.url}: key {key!r} changed (expected version {etag})")
            _write_local_atomic(path, lambda tmp: tmp.write_bytes(data))
        return _etag(data)

    @contextmanager
    def _key_lock(self, path: Path) -> Iterator[None]:
        """Hold the lock every ``put_if_match`` of ``path`` takes (a hidden file ``list`` skips)."""
        lock = path.with_name(f".{path.name}{_TMP_MARK}lock")
        try:
            _mkdirs(path.parent)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise StorageError(
                f"cannot open lock file {lock}: {err.strerror or err}; check that {self.root} is writable"
            ) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as err:
                raise StorageError(
                    f"cannot lock {lock}: {err.strerror or err}; conditional writes on a local "
                    "directory need a filesystem with file locks (a local disk, or NFS with locking)"
                ) from None
            yield
        finally:
            os.close(fd)

    def iter_bytes(self, key: str, chunk: int = 4 * MiB) -> Iterator[bytes]:
        try:
            f = open(self._file(key), "rb")
        except FileNotFoundError:  # deleted since _file looked
            raise NotFound(f"{self.url}: key {key!r} does not exist") from None
        with f:
            while block := f.read(chunk):
                yield block

    def get_file(self, key: str, path: str | Path) -> None:
        src = self._file(key)
        _write_local_atomic(path, lambda tmp: shutil.copyfile(src, tmp))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        return self._file(key).stat().st_size

    def list(self, prefix: str = "") -> list[str]:
        head = check_key(prefix, prefix=True).rpartition("/")[0]
        keys = []
        for dirpath, _, files in os.walk(self.root.joinpath(*head.split("/")) if head else self.root):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix) and not (name.startswith(".") and _TMP_MARK in name):
                    keys.append(key)  # (skipped: an in-flight or abandoned atomic write)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return
        fsync_dir(path.parent)

    def delete_prefix(self, prefix: str) -> None:
        prefix = _dir_prefix(prefix)
        if prefix == "":
            for key in self.list():
                self.delete(key)
        elif (target := self._path(prefix[:-1])).is_dir():
            shutil.rmtree(target)
            fsync_dir(target.parent)

    def move_prefix(self, src: str, dst: str) -> None:
        source, target = self._path(_dir_prefix(src)[:-1]), self._path(_dir_prefix(dst)[:-1])
        if not source.is_dir():
            return
        _mkdirs(target.parent)
        os.rename(source, target)  # one atomic rename on the same file system
        fsync_dir(source.parent)
        fsync_dir(target.parent)

    def local_path(self, key: str) -> Path:
        return self._path(key)
