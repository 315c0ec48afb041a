"""Hashing what a checkpoint writer streams, while it streams (the shard's sha256 for its manifest)."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor


class HashingWriter:
    """A file wrapper that hashes and counts what ``torch.save`` streams through it. A large
    chunk (a tensor's bytes) is hashed on a helper thread while it is written — both release
    the GIL — and ``write`` returns only when both are done, so the caller may reuse its buffer."""

    PARALLEL_MIN = 1 << 20

    def __init__(self, f, pool: ThreadPoolExecutor):
        self.f, self.pool, self.sha, self.bytes = f, pool, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.bytes += len(b)
        if len(b) < self.PARALLEL_MIN:
            self.sha.update(b)
            return self.f.write(b)
        hashed = self.pool.submit(self.sha.update, b)
        try:
            return self.f.write(b)
        finally:
            hashed.result()

    def flush(self) -> None:
        self.f.flush()
