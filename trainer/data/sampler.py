"""Packed token shards and a sampler indexed by global sample position.

A *sample* is a window of ``seq_len + 1`` tokens cut from one shard (inputs and shifted
targets). Samples are visited in a seeded permutation per epoch; the position in that order is
one integer (``consumed`` samples), so resuming is exact and any world size reads a disjoint,
complete partition of each global batch.

A stage may draw from named groups of the data set in fixed proportions (a *mixture*):
:class:`MixtureSampler` assigns each global position to a group by a periodic, smooth weighted
round-robin schedule, and counts within the group in closed form — still one integer of state.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.data.manifest import DataError, read_manifest


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
        self.groups: dict[str, range] = {}  # group → its windows (shards are written group by group)
        for shard in shards:
            arr = np.memmap(Path(data_dir) / shard["file"], dtype=dtype, mode="r")
            n = (len(arr) - 1) // seq_len
            if n <= 0:
                continue
            group = shard.get("group", "all")
            first = self.groups[group].start if group in self.groups else total
            self.groups[group] = range(first, total + n)
            self._arrays.append(arr)
            self._starts.append(total)
            total += n
        if total == 0:
            raise DataError(
                f"split {split!r} in {data_dir} has no window of {seq_len + 1} tokens: add data or shorten seq_len"
            )
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


class MixtureSampler:
    """Global position → window index for a mixture of groups with weights.

    Integer weights (the float weights scaled to a resolution of 1/1000 and reduced) define a
    period; within each period, slots go to groups by smooth weighted round-robin, so the mix is
    even at every scale. The ``k``-th sample of a group is that group's own seeded permutation
    at ``k``: exact for any position, with no state but the position."""

    def __init__(self, groups: dict[str, range], weights: dict[str, float], seed: int, stream: int = 0):
        missing = sorted(set(weights) - set(groups))
        if missing:
            raise DataError(f"mixture names data group(s) {missing}, but the data set has {sorted(groups)}")
        names = sorted(g for g, w in weights.items() if w > 0)
        total = sum(weights[g] for g in names)
        ints = [max(1, round(1000 * weights[g] / total)) for g in names]
        div = math.gcd(*ints)
        ints = [w // div for w in ints]
        self.period = sum(ints)
        current, self.schedule = [0] * len(names), []
        for _ in range(self.period):
            current = [c + w for c, w in zip(current, ints)]
            pick = max(range(len(names)), key=lambda i: (current[i], -i))
            current[pick] -= self.period
            self.schedule.append(pick)
        self.before = [[0] * len(names)]  # before[j][g]: slots of g among the first j of a period
        for pick in self.schedule:
            row = list(self.before[-1])
            row[pick] += 1
            self.before.append(row)
        self.names, self.ints, self.ranges = names, ints, [groups[g] for g in names]
        self.samplers = [GlobalSampler(len(groups[g]), seed, stream=stream * 1009 + 1 + i) for i, g in enumerate(names)]

    def index(self, position: int) -> int:
        cycle, slot = divmod(position, self.period)
        g = self.schedule[slot]
        k = cycle * self.ints[g] + self.before[slot][g]
        return self.ranges[g].start + self.samplers[g].index(k)


def make_sampler(windows: TokenWindows, mixture: dict[str, float], seed: int, stream: int):
    """The stage's sampler: the whole split in one permutation, or the stage's mixture."""
    if not mixture:
        return GlobalSampler(len(windows), seed, stream=stream)
    return MixtureSampler(windows.groups, mixture, seed, stream)


def micro_batch_positions(consumed: int, *, world: int, rank: int, micro: int, accum_index: int) -> range:
    """Global sample positions that ``rank`` reads in micro-step ``accum_index`` of the step
    starting at ``consumed``. Over all ranks and micro-steps a step covers
    ``[consumed, consumed + world * micro * accum)`` exactly once."""
    start = consumed + (accum_index * world + rank) * micro
    return range(start, start + micro)


def make_batch(
    windows: TokenWindows, sampler: GlobalSampler | MixtureSampler, positions: range
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([windows[sampler.index(p)] for p in positions])
    return rows[:, :-1], rows[:, 1:]
