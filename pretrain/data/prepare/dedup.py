"""The set of document hashes that exact deduplication checks: 8 bytes per distinct document
(a Python set of ints takes about 70), so a corpus of 100 M documents needs under 1 GB.

Sorted numpy blocks, merged like a binary counter (each block at least twice the next), so a
lookup searches O(log n) blocks and each hash is re-sorted O(log n) times in all."""

from __future__ import annotations

import numpy as np


class HashSet:
    """Distinct uint64 hashes seen so far."""

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] = []  # sorted, distinct, sizes decreasing

    def __len__(self) -> int:
        return sum(len(b) for b in self.blocks)

    def first_seen(self, hashes: np.ndarray) -> np.ndarray:
        """Mask over ``hashes``: True where the hash was seen neither before nor earlier in
        ``hashes`` (the first of equal hashes wins); those are added."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        first = np.zeros(len(hashes), dtype=bool)
        first[np.unique(hashes, return_index=True)[1]] = True
        for block in self.blocks:
            at = np.minimum(np.searchsorted(block, hashes), len(block) - 1)
            first &= block[at] != hashes
        self._push(np.sort(hashes[first]))
        return first

    def _push(self, block: np.ndarray) -> None:
        if not len(block):
            return
        while self.blocks and len(self.blocks[-1]) <= 2 * len(block):
            block = np.sort(np.concatenate([self.blocks.pop(), block]))
        self.blocks.append(block)
