"""``open_storage``: the URL's scheme picks the backend; the S3 backend (and so boto3) is
imported only for ``s3://`` URLs."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from trainer.storage.base import Storage
from trainer.storage.local import LocalStorage


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
            raise ValueError(
                "an s3:// URL must be s3://bucket/prefix, without credentials; pass access_key/secret_key as options"
            )
        from trainer.storage.s3 import S3Storage  # boto3 only where S3 is used

        return S3Storage(parsed.netloc, parsed.path.strip("/"), **s3_options)
    raise ValueError(f"unsupported storage URL scheme {parsed.scheme!r}: use file:// or s3://")
