"""The local-directory storage backend (``file:///dir`` or a plain path)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from trainer.atomic import atomic_write_bytes, fsync_dir
from trainer.storage.base import _TMP_MARK, MiB, NotFound, Storage, _dir_prefix, _mkdirs, _write_local_atomic, check_key


class LocalStorage(Storage):
    """A directory on a local (or mounted) file system."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _file(self, key: str) -> Path:
        path = self._path(key)
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
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"{self.url}: key {key!r} does not exist") from None

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
