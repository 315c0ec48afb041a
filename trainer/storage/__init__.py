"""Checkpoint storage: one small interface (``base``), a local-directory backend (``local``) and
an S3 backend (``s3``, imported only for ``s3://`` URLs); ``open_storage`` picks the backend by
the URL's scheme.

Keys are "/"-separated paths relative to the storage root; writes are atomic (a reader sees the
old object or the complete new one).
"""

from trainer.storage.base import (
    MiB,
    NotAFile,
    NotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    StorageUnreachable,
    check_key,
)
from trainer.storage.local import LocalStorage
from trainer.storage.url import open_storage

__all__ = [
    "LocalStorage",
    "MiB",
    "NotAFile",
    "NotFound",
    "PreconditionFailed",
    "Storage",
    "StorageError",
    "StorageUnreachable",
    "check_key",
    "open_storage",
]
