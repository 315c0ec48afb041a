"""Checkpoint storage, the interface: ``Storage``, its errors and key rules, shared by the
local-directory backend (``trainer.storage.local``) and the S3 backend (``trainer.storage.s3``);
``trainer.storage.url.open_storage`` picks one by the URL's scheme.

Keys are "/"-separated paths relative to the storage root ("step_000100/model.pt"); a key can
never leave the root. Writes are atomic: a reader sees the old object or the complete new one.
Pure python; boto3 is imported only when an S3 backend creates its client.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from trainer.common.atomic import fsync_dir, replace_moving_aside

MiB = 1 << 20
_TMP_MARK = ".tmp-"  # temporaries are ".<name>.tmp-<pid>..." next to their target


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URL, what failed and what to do."""


class StorageUnreachable(StorageError):
    """The storage cannot be reached now (no connection, a timeout, an error on its side): worth
    retrying later, unlike a refusal (credentials, a missing bucket, a full disk)."""


class NotFound(StorageError):
    """The key does not exist."""


class NotAFile(StorageError):
    """The key's name is taken by something that is not an object (a directory on a local disk):
    damage of that key, for its reader to report; the next write of the key moves it aside."""


class PreconditionFailed(StorageError):
    """A conditional write lost a race: ``put_if_absent`` found the key already there, or
    ``put_if_match`` found it changed (or gone) since the caller read it. Nothing was written."""


def check_key(key: str, *, prefix: bool = False) -> str:
    """``key`` if it is a safe relative key; a prefix may also be "" or end in "/"."""
    body = key[:-1] if prefix and isinstance(key, str) and key.endswith("/") else key
    if not (
        isinstance(key, str)
        and not key.startswith("/")
        and not {"\\", "\x00"} & set(key)
        and ((prefix and key == "") or (body and all(seg not in ("", ".", "..") for seg in body.split("/"))))
    ):
        raise ValueError(
            f"invalid storage key {key!r}: keys are '/'-separated relative paths "
            "without a leading '/', '..', '.', empty segments or backslashes"
        )
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


def _write_local_atomic(dst: str | Path, write, publish=replace_moving_aside) -> None:
    """Call ``write(tmp)`` to fill a temporary next to ``dst``, then fsync, ``publish(tmp, dst)``
    (a rename, moving a directory squatting on ``dst`` aside; ``os.link`` to fail if ``dst`` exists), fsync dir."""
    dst = Path(dst).absolute()
    _mkdirs(dst.parent)
    tmp = dst.with_name(f".{dst.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        publish(tmp, dst)
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

    # Conditional writes (compare-and-swap on one key): what a lease or a ledger shared by
    # several writers needs, so that a lost race is an error and never a silent overwrite.
    # An ETag is an opaque version token: equal tokens mean equal contents.
    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and its ETag (NotFound if missing)."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> str:
        """Create ``key`` only if it does not exist; its new ETag. PreconditionFailed if it does."""

    @abstractmethod
    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """Replace ``key`` only if its ETag is still ``etag``; the new ETag. PreconditionFailed
        if it changed or is gone."""

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
                self.put_file(dst + key[len(src) :], local)
        self.delete_prefix(src)

    def local_path(self, key: str) -> Path | None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
