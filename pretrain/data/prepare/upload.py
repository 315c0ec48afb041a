"""Putting a data set staged on the local disk into S3 while it is being written: each file is
uploaded as soon as it is complete (a few at a time) and its local copy then removed, so
staging needs a few shards of disk, not a second copy of the data set; the manifest goes up
last, once every other file is stored."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pretrain.data.prepare.errors import DataPrepError
from trainer.storage import Storage, StorageError

UPLOADS = 8  # files uploaded at once (one boto3 client is thread-safe)


class Uploader:
    """``uploader(path)`` after each staged file is written; ``finish(manifest)`` at the end."""

    def __init__(self, target: Storage, location: str):
        self.target, self.location = target, location
        self.pool = ThreadPoolExecutor(UPLOADS, thread_name_prefix="data-upload")
        self.pending: deque[Future] = deque()

    def _put(self, path: Path) -> None:
        self.target.put_file(path.name, path)
        path.unlink()

    def _wait(self, future: Future) -> None:
        try:
            future.result()
        except StorageError as err:
            raise DataPrepError(
                f"uploading the data set to {self.location} failed: {err}; run again (the "
                "tokenized units are kept, and a data set without its manifest is never used)"
            ) from None

    def __call__(self, path: Path) -> None:
        self.pending.append(self.pool.submit(self._put, path))
        while len(self.pending) > 2 * UPLOADS:  # bounded: staging holds a few files at most
            self._wait(self.pending.popleft())

    def finish(self, manifest: Path) -> None:
        """Wait for every file, then upload the manifest: from here the data set counts."""
        try:
            while self.pending:
                self._wait(self.pending.popleft())
            self._wait(self.pool.submit(self._put, manifest))
        finally:
            self.close()

    def close(self) -> None:
        for future in self.pending:
            future.cancel()
        self.pool.shutdown(wait=True)
