"""Work units: the pieces of a corpus that one worker reads and tokenizes independently, so the
memory of data preparation is bounded by workers × unit size whatever the corpus size.

An uncompressed text/JSONL file is cut into byte ranges of ``unit_bytes``; a line belongs to the
unit its first byte is in, so every line is read exactly once whatever the cut. A compressed
file cannot be entered in the middle: it is one unit. A Parquet file is cut into runs of row
groups of about ``unit_bytes`` (uncompressed)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from pretrain.data.corpus.files import SourceFile


@dataclass(frozen=True)
class WorkUnit:
    """Lines whose first byte is in [start, stop) of ``source`` (text/JSONL), or its row groups
    [start, stop) (Parquet)."""

    source: SourceFile
    start: int
    stop: int
    chunk_bytes: int = 0  # a compressed text file: one document per this many (decompressed) bytes

    @property
    def key(self) -> str:
        """Stable across runs while the file (its identity) and the range are the same: what a
        finished unit's result is recorded under. It covers the input only; whoever caches a
        unit's output also keys it by :func:`pretrain.data.corpus.readers.reader_settings` and the
        tokenizer."""
        s = self.source
        text = json.dumps(
            [s.uri, s.identity, s.format, s.compression, s.text_field, self.start, self.stop, self.chunk_bytes]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def byte_ranges(size: int, unit_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of ``unit_bytes`` covering ``size`` bytes (one empty range for 0)."""
    return [(start, min(start + unit_bytes, size)) for start in range(0, size, unit_bytes)] or [(0, 0)]


def batch_row_groups(sizes: list[int], unit_bytes: int) -> list[tuple[int, int]]:
    """Runs [start, stop) of consecutive row groups, each closed once it holds ``unit_bytes``."""
    runs, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total >= unit_bytes:
            runs.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


def plan_units(source: SourceFile, unit_bytes: int, s3_options: dict | None = None) -> list[WorkUnit]:
    """The units of one file, in file order (Parquet reads the file's footer)."""
    if unit_bytes <= 0:
        raise ValueError(f"unit_bytes must be positive, not {unit_bytes}")
    if source.format == "parquet":
        from pretrain.data.corpus.parquet import row_group_sizes

        ranges = batch_row_groups(row_group_sizes(source, s3_options), unit_bytes)
    elif source.compression:
        ranges = [(0, source.size)]
    else:
        ranges = byte_ranges(source.size, unit_bytes)
    chunk = unit_bytes if source.compression and source.format == "text" else 0
    return [WorkUnit(source, start, stop, chunk) for start, stop in ranges]
