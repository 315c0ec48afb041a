"""Checkpoint storage: one small interface, a local-directory backend (here) and an S3
backend (``trainer.s3storage``).

Keys are "/"-separated paths relative to the storage root ("step_000100/model.pt"); a key can
never leave the root. Writes are atomic: a reader sees the old object or the complete new one.
Pure python; boto3 is imported only when an S3 backend creates its client.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import BinaryIO, Callable, Iterator
from urllib.parse import unquote, urlparse

from trainer.atomic import atomic_write_bytes, fsync_dir

MiB = 1 << 20
_TMP_MARK = ".tmp-"  # temporaries are ".<name>.tmp-<pid>..." next to their target


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URL, what failed and what to do."""


class NotFound(StorageError):
    """The key does not exist."""


def check_key(key: str, *, prefix: bool = False) -> str:
    """``key`` if it is a safe relative key; a prefix may also be "" or end in "/"."""
    body = key[:-1] if prefix and isinstance(key, str) and key.endswith("/") else key
    if not (isinstance(key, str) and not key.startswith("/") and not {"\\", "\x00"} & set(key)
            and ((prefix and key == "") or (body and all(seg not in ("", ".", "..")
                                                         for seg in body.split("/"))))):
        raise ValueError(f"invalid storage key {key!r}: keys are '/'-separated relative paths "
                         "without a leading '/', '..', '.', empty segments or backslashes")
    return key


def _dir_prefix(prefix: str) -> str:
    check_key(prefix, prefix=True)
    return prefix if prefix == "" or prefix.endswith("/") else prefix + "/"


def _mkdirs(directory: Path) -> None:
    """Create missing directories and make their entries durable (fsync each parent)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


def _write_local_atomic(dst: str | Path, write) -> None:
    """Call ``write(tmp)`` to fill a temporary next to ``dst``, then fsync, rename, fsync dir."""
    dst = Path(dst).absolute()
    _mkdirs(dst.parent)
    tmp = dst.with_name(f".{dst.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(dst.parent)


class Storage(ABC):
    """Writes are atomic and durable; reading a missing key raises NotFound; any other failure
    raises StorageError; a key that would leave the root raises ValueError."""

    url: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...
    @abstractmethod
    def put_file(self, key: str, path: str | Path) -> None: ...
    @abstractmethod
    def put_stream(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        """Store what ``write(f)`` writes sequentially to ``f``; nothing if it raises."""
    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...
    @abstractmethod
    def iter_bytes(self, key: str, chunk: int = 4 * MiB) -> Iterator[bytes]:
        """The object's bytes in blocks of at most ``chunk`` (never all of it in memory at once)."""
    @abstractmethod
    def get_file(self, key: str, path: str | Path) -> None:
        """Download to the local ``path``, atomically replacing it."""
    @abstractmethod
    def exists(self, key: str) -> bool: ...
    @abstractmethod
    def size(self, key: str) -> int: ...
    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with the string ``prefix`` ("step_1" matches "step_10/a")."""
    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is fine."""
    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under the directory ``prefix`` ("a" means "a/", "" means all)."""

    def move_prefix(self, src: str, dst: str) -> None:
        """Move every key under the directory ``src`` to the same key under ``dst`` (copy, then
        delete the source: a crash in between leaves both copies, never neither)."""
        src, dst = _dir_prefix(src), _dir_prefix(dst)
        with tempfile.TemporaryDirectory(prefix="pretrain-move-") as tmp:
            for key in self.list(src):
                local = Path(tmp) / "object"
                self.get_file(key, local)
                self.put_file(dst + key[len(src):], local)
        self.delete_prefix(src)

    def local_path(self, key: str) -> Path | None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


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


def open_storage(url: str | Path, **s3_options) -> Storage:
    """``file:///dir``, a plain path, or ``s3://bucket/prefix`` (options go to S3Storage)."""
    url = os.fspath(url)
    parsed = urlparse(url) if "://" in url else None
    if parsed is None or parsed.scheme == "file":
        if s3_options:
            raise ValueError(f"options {sorted(s3_options)} only apply to s3:// storage URLs")
        if parsed is not None and parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URL {url!r} must name a local path (file:///abs/dir)")
        return LocalStorage(unquote(parsed.path) if parsed is not None else url)
    if parsed.scheme == "s3":
        if "@" in parsed.netloc or not parsed.netloc:
            raise ValueError("an s3:// URL must be s3://bucket/prefix, without credentials; "
                             "pass access_key/secret_key as options")
        from trainer.s3storage import S3Storage  # boto3 only where S3 is used

        return S3Storage(parsed.netloc, parsed.path.strip("/"), **s3_options)
    raise ValueError(f"unsupported storage URL scheme {parsed.scheme!r}: use file:// or s3://")
