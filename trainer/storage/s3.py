"""The S3 backend of :mod:`trainer.storage`: objects under ``s3://bucket/prefix`` on AWS S3 or
an S3-compatible server (MinIO, SeaweedFS) through boto3, which is imported on first use."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from trainer.storage.base import (
    MiB,
    NotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    StorageUnreachable,
    _dir_prefix,
    _write_local_atomic,
    check_key,
)
from trainer.storage.streaming import pipe_to

_AUTH_CODES = {
    "SignatureDoesNotMatch",
    "InvalidAccessKeyId",
    "AccessDenied",
    "403",
    "InvalidToken",
    "ExpiredToken",
    "AuthorizationHeaderMalformed",
}


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key (relative to the storage root), size and ETag."""

    key: str
    size: int
    etag: str


# A conditional request that lost: 412, or 409 when AWS sees two conditional writes of one key
# in flight at once (the other one may still win).
_CONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
# the server's own trouble (or too many requests): the same request may succeed later
_SERVER_SIDE_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling"}


class S3Storage(Storage):
    """Objects under ``s3://bucket/prefix`` on AWS S3 or an S3-compatible server.

    A PUT and a completed multipart upload are each all-or-nothing in S3, so readers never see
    a partial object. boto3 aborts a failed multipart upload; when the server is gone it cannot,
    and ``abort_incomplete_uploads`` reclaims those parts later.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        multipart_threshold: int = 8 * MiB,
        multipart_chunksize: int = 8 * MiB,
        max_attempts: int = 5,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_concurrency: int = 4,
        addressing_style: str | None = None,
    ):
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        self.bucket, self.prefix = bucket, check_key(p) if (p := prefix.strip("/")) else ""
        self.endpoint_url, self.region = endpoint_url, region
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._access_key, self._secret_key = access_key, secret_key
        self._session_token, self._profile = session_token, profile
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self.max_attempts, self.max_concurrency = max_attempts, max_concurrency
        self.timeouts = (connect_timeout, read_timeout)
        self.addressing_style = addressing_style or ("path" if endpoint_url else "auto")
        self._client = self._transfer = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        where = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Storage({self.url!r}{where})"

    def __getstate__(self) -> dict:  # picklable for worker processes; clients are not
        state = {k: v for k, v in self.__dict__.items() if k != "_lock"}
        return {**state, "_client": None, "_transfer": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def client(self):
        """The boto3 S3 client, created on first use (event hooks may be registered on it)."""
        with self._lock:
            if self._client is None:
                import boto3
                from boto3.s3.transfer import TransferConfig
                from botocore.config import Config

                config = Config(
                    retries={"max_attempts": self.max_attempts, "mode": "standard"},
                    connect_timeout=self.timeouts[0],
                    read_timeout=self.timeouts[1],
                    s3={"addressing_style": self.addressing_style},
                    max_pool_connections=max(10, 2 * self.max_concurrency),
                )
                self._client = boto3.session.Session(profile_name=self._profile).client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    region_name=self.region,
                    aws_access_key_id=self._access_key,
                    aws_secret_access_key=self._secret_key,
                    aws_session_token=self._session_token,
                    config=config,
                )
                self._transfer = TransferConfig(
                    multipart_threshold=self.multipart_threshold,
                    multipart_chunksize=self.multipart_chunksize,
                    max_concurrency=self.max_concurrency,
                    preferred_transfer_client="classic",
                )
            return self._client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}" if self.prefix else check_key(key)

    def _error(self, op: str, key: str, exc: BaseException) -> StorageError:
        from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

        where = f"{self.url}/{key}" if key else self.url
        cause = exc  # boto3 wraps upload ClientErrors in S3UploadFailedError
        while cause is not None and not isinstance(cause, ClientError):
            cause = cause.__cause__ or cause.__context__
        code, detail = None, f"{type(exc).__name__}: {exc}"
        if cause is not None:
            err, meta = cause.response.get("Error", {}), cause.response.get("ResponseMetadata", {})
            code = str(err.get("Code") or meta.get("HTTPStatusCode"))
            detail = f"{code}: {err.get('Message') or 'no message'}"
        if code in ("404", "NoSuchKey", "NotFound"):
            return NotFound(f"{where} does not exist")
        if code in _AUTH_CODES:
            hint = "check the access key, secret key and the bucket's permissions"
        elif code == "NoSuchBucket":
            hint = f"create bucket {self.bucket!r} or fix the storage URL"
        elif code in _CONDITION_CODES:
            return PreconditionFailed(
                f"S3 {op} of {where} failed ({detail}): the object changed since it was "
                "listed or read (its ETag differs), or already exists; run again"
            )
        elif isinstance(exc, (ConnectionError, HTTPClientError)):
            hint = (
                f"gave up after {self.max_attempts} attempts; check that the S3 endpoint "
                f"{self.endpoint_url or '(AWS)'} is up and reachable, then retry"
            )
        else:
            hint = "check the S3 server and retry"
        msg = f"S3 {op} of {where} failed ({detail}); {hint}"
        away = (
            isinstance(exc, (ConnectionError, HTTPClientError))
            or code in _SERVER_SIDE_CODES
            or (code or "").startswith("5")
        )
        msg = msg.replace(self._secret_key, "***") if self._secret_key else msg
        return StorageUnreachable(msg) if away else StorageError(msg)

    def _call(self, op: str, key: str, fn, *args, **kwargs):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except (ClientError, BotoCoreError, Boto3Error) as exc:
            raise self._error(op, key, exc) from None

    def put_bytes(self, key: str, data: bytes) -> None:
        k = self._key(key)
        self._call("upload", key, self.client.upload_fileobj, io.BytesIO(data), self.bucket, k, Config=self._transfer)

    def put_file(self, key: str, path: str | Path) -> None:
        k = self._key(key)
        self._call("upload", key, self.client.upload_file, os.fspath(path), self.bucket, k, Config=self._transfer)

    def put_stream(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        """Upload straight from ``write`` through a pipe (multipart above the threshold, in
        chunks of ``multipart_chunksize``): no local temporary file, no full copy in memory."""
        k, client = self._key(key), self.client
        pipe_to(
            write,
            lambda reader: self._call(
                "upload", key, client.upload_fileobj, reader, self.bucket, k, Config=self._transfer
            ),
        )

    def get_bytes(self, key: str) -> bytes:
        k = self._key(key)
        resp = self._call("download", key, self.client.get_object, Bucket=self.bucket, Key=k)
        return self._call("download", key, resp["Body"].read)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        k = self._key(key)
        resp = self._call("download", key, self.client.get_object, Bucket=self.bucket, Key=k)
        return self._call("download", key, resp["Body"].read), resp["ETag"].strip('"')

    def put_if_absent(self, key: str, data: bytes) -> str:
        """One PUT with ``If-None-Match: *`` (S3 rejects it with 412 if the key exists)."""
        return self._put_conditional(key, data, IfNoneMatch="*")

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """One PUT with ``If-Match: "etag"``; a key that is gone counts as changed."""
        try:
            return self._put_conditional(key, data, IfMatch=f'"{etag}"')
        except NotFound:
            raise PreconditionFailed(f"{self.url}/{key} is gone (expected version {etag})") from None

    def _put_conditional(self, key: str, data: bytes, **condition: str) -> str:
        k = self._key(key)
        resp = self._call(
            "conditional upload", key, self.client.put_object, Bucket=self.bucket, Key=k, Body=data, **condition
        )
        return resp["ETag"].strip('"')

    def iter_bytes(self, key: str, chunk: int = 4 * MiB) -> Iterator[bytes]:
        """Stream the object's body (one GET) in blocks of ``chunk``."""
        k = self._key(key)
        body = self._call("download", key, self.client.get_object, Bucket=self.bucket, Key=k)["Body"]
        try:
            blocks = body.iter_chunks(chunk)
            while block := self._call("download", key, next, blocks, b""):
                yield block
        finally:
            body.close()

    def read_range(self, key: str, start: int, stop: int, etag: str | None = None) -> bytes:
        """Bytes [start, stop) of the object (one ranged GET); with ``etag``, only of that version
        of it (a changed object fails instead of mixing two versions)."""
        if stop <= start:
            return b""
        k, extra = self._key(key), {"IfMatch": etag} if etag else {}
        resp = self._call(
            "download",
            key,
            self.client.get_object,
            Bucket=self.bucket,
            Key=k,
            Range=f"bytes={start}-{stop - 1}",
            **extra,
        )
        return self._call("download", key, resp["Body"].read)

    def get_file(self, key: str, path: str | Path) -> None:
        k, client = self._key(key), self.client
        _write_local_atomic(
            path,
            lambda tmp: self._call(
                "download", key, client.download_file, self.bucket, k, str(tmp), Config=self._transfer
            ),
        )

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except NotFound:
            return False

    def size(self, key: str) -> int:
        k = self._key(key)
        return self._call("stat", key, self.client.head_object, Bucket=self.bucket, Key=k)["ContentLength"]

    def _paginate(self, op: str, prefix: str, item: str) -> list[dict]:
        root = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator(op).paginate(Bucket=self.bucket, Prefix=root + check_key(prefix, prefix=True))
        return [x for page in self._call("list", prefix, list, pages) for x in page.get(item, [])]

    def list(self, prefix: str = "") -> list[str]:
        skip = len(self.prefix) + 1 if self.prefix else 0
        objects = self._paginate("list_objects_v2", prefix, "Contents")
        return sorted(obj["Key"][skip:] for obj in objects)

    def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        """Like :meth:`list`, with each object's size and ETag (its version identity)."""
        skip = len(self.prefix) + 1 if self.prefix else 0
        return sorted(
            (
                ObjectInfo(o["Key"][skip:], o["Size"], o.get("ETag", "").strip('"'))
                for o in self._paginate("list_objects_v2", prefix, "Contents")
            ),
            key=lambda o: o.key,
        )

    def delete(self, key: str) -> None:
        k = self._key(key)
        self._call("delete", key, self.client.delete_object, Bucket=self.bucket, Key=k)

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list(_dir_prefix(prefix))
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            resp = self._call(
                "delete",
                prefix,
                self.client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": batch, "Quiet": True},
            )
            if errors := resp.get("Errors"):
                e = errors[0]
                raise StorageError(
                    f"S3 delete of {self.url}/{prefix} failed for {len(errors)} "
                    f"keys (first: {e.get('Key')}: {e.get('Code')} "
                    f"{e.get('Message')}); retry delete_prefix"
                )

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Abort unfinished multipart uploads under ``prefix``; returns how many were aborted."""
        uploads = self._paginate("list_multipart_uploads", prefix, "Uploads")
        for u in uploads:
            self._call(
                "abort upload",
                prefix,
                self.client.abort_multipart_upload,
                Bucket=self.bucket,
                Key=u["Key"],
                UploadId=u["UploadId"],
            )
        return len(uploads)
