"""Packed token shards and a sampler indexed by global sample position.

A *sample* is a window of ``seq_len + 1`` tokens cut from one shard (inputs and shifted
targets). Samples are visited in a seeded permutation per epoch; the position in that order is
one integer (``consumed`` samples), so resuming is exact and any world size reads a disjoint,
complete partition of each global batch.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MANIFEST = "manifest.json"


class DataError(RuntimeError):
    """The prepared data set is missing or unusable; the message names the file."""


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"no data manifest at {path}: run data preparation first (`pretrain run` does)") from None


class TokenWindows:
    """Fixed-length token windows over the shards of one split, memory-mapped."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int):
        manifest = read_manifest(data_dir)
        shards = manifest["splits"].get(split) or []
        dtype = np.dtype(manifest["dtype"])
        self.seq_len = seq_len
        self._arrays: list[np.ndarray] = []
        self._starts: list[int] = []
        total = 0
        for shard in shards:
            arr = np.memmap(Path(data_dir) / shard["file"], dtype=dtype, mode="r")
            n = (len(arr) - 1) // seq_len
            if n <= 0:
                continue
            self._arrays.append(arr)
            self._starts.append(total)
            total += n
        if total == 0:
            raise DataError(f"split {split!r} in {data_dir} has no window of {seq_len + 1} tokens: add data or shorten seq_len")
        self._len = total

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> torch.Tensor:
        s = bisect.bisect_right(self._starts, i) - 1
        off = (i - self._starts[s]) * self.seq_len
        window = self._arrays[s][off : off + self.seq_len + 1]
        return torch.from_numpy(window.astype(np.int64))


@dataclass
class GlobalSampler:
    """Maps a global sample position to a window index: a seeded permutation per epoch."""

    num_samples: int
    seed: int
    stream: int = 0  # distinguishes data orders (e.g. one per stage)

    def __post_init__(self) -> None:
        self._cache: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.stream * 7_919 + epoch)
            self._cache = {epoch: torch.randperm(self.num_samples, generator=g)}
        return self._cache[epoch]

    def index(self, position: int) -> int:
        epoch, i = divmod(position, self.num_samples)
        return int(self._perm(epoch)[i])


def micro_batch_positions(consumed: int, *, world: int, rank: int, micro: int, accum_index: int) -> range:
    """Global sample positions that ``rank`` reads in micro-step ``accum_index`` of the step
    starting at ``consumed``. Over all ranks and micro-steps a step covers
    ``[consumed, consumed + world * micro * accum)`` exactly once."""
    start = consumed + (accum_index * world + rank) * micro
    return range(start, start + micro)


def make_batch(windows: TokenWindows, sampler: GlobalSampler, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([windows[sampler.index(p)] for p in positions])
    return rows[:, :-1], rows[:, 1:]
