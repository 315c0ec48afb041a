"""Finished units → the data set's shards: units in source order, exact duplicates dropped
(first wins), each document to train or val by its hash, train documents repeated by their
source's weight, packed with a separator after each document into fixed-size shards per
(split, group). Only the unit results are read, so the output cannot depend on how many
workers made them; memory is one shard buffer per split plus the set of document hashes
(8 bytes per distinct document, :mod:`pretrain.data.prepare.dedup`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrain.data.prepare.dedup import HashSet
from pretrain.data.prepare.unitcache import UnitResult, load_docs, load_tokens
from trainer.common.atomic import atomic_write_bytes

TWO64 = 1 << 64
_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class AssembledUnit:
    """One finished unit as assembly reads it."""

    source_index: int  # into the flat list of sources
    group: str
    weight: float
    path: Path
    result: UnitResult


@dataclass
class SourceStats:
    units: int = 0
    documents: int = 0
    tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


class ShardWriter:
    """Packs token runs into ``<stem>_NNNNN.bin`` files of ``shard_tokens`` tokens (the last one
    shorter), each written atomically as soon as it is full."""

    def __init__(
        self,
        out: Path,
        stem: str,
        group: str,
        dtype: str,
        shard_tokens: int,
        written: list[Path],
        on_shard: Callable[[Path], None] | None = None,
    ):
        self.out, self.stem, self.group, self.written, self.on_shard = out, stem, group, written, on_shard
        self.buf = np.empty(shard_tokens, dtype=dtype)
        self.fill = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            take = min(len(tokens), len(self.buf) - self.fill)
            self.buf[self.fill : self.fill + take] = tokens[:take]
            self.fill += take
            tokens = tokens[take:]
            if self.fill == len(self.buf):
                self.flush()

    def flush(self) -> None:
        if self.fill:
            name = f"{self.stem}_{len(self.shards):05d}.bin"
            path = self.out / name
            self.written.append(path)
            digest = atomic_write_bytes(path, self.buf[: self.fill].tobytes())
            self.shards.append({"file": name, "tokens": int(self.fill), "sha256": digest, "group": self.group})
            self.fill = 0
            if self.on_shard:
                self.on_shard(path)


def split_rule(units: list[AssembledUnit], val_fraction: float) -> tuple[int, int | None, int | None]:
    """(threshold, forced_val, forced_train): a document is val if its hash is below the threshold;
    if none is, the smallest hash goes to val; if all are, the largest goes to train."""
    hashes = [(u.result.min_hash, u.result.max_hash) for u in units if u.result.documents]
    lo, hi = min(h[0] for h in hashes), max(h[1] for h in hashes)
    threshold = int(val_fraction * TWO64)
    return threshold, (lo if lo >= threshold else None), (hi if hi < threshold else None)


def repeats(hashes: np.ndarray, weight: float) -> np.ndarray:
    """How often each train document appears: ``floor(weight)`` plus one for a deterministic,
    hash-chosen share ``weight - floor(weight)`` of them."""
    whole, frac = int(weight), weight - int(weight)
    extra = ((hashes * _MIX) >> np.uint64(11)).astype(np.float64) / float(1 << 53) < frac
    return whole + extra.astype(np.int64)


def assemble(
    units: list[AssembledUnit],
    groups: list[str],
    *,
    out: Path,
    dtype: str,
    eot_id: int,
    val_fraction: float,
    shard_tokens: int,
    n_sources: int,
    written: list[Path],
    on_shard: Callable[[Path], None] | None = None,
):
    """Write every shard into ``out`` (``on_shard(path)`` after each); returns (splits, documents
    per split, per-source stats)."""
    threshold, forced_val, forced_train = split_rule(units, val_fraction)
    seen = HashSet()
    stats = [SourceStats() for _ in range(n_sources)]
    splits: dict[str, list[dict]] = {"train": [], "val": []}
    documents = {"train": 0, "val": 0}
    eot = np.asarray([eot_id], dtype=dtype)
    for group in groups:
        writers = {
            split: ShardWriter(
                out, split if group == "all" else f"{split}_{group}", group, dtype, shard_tokens, written, on_shard
            )
            for split in splits
        }
        for u in (u for u in units if u.group == group):
            st = stats[u.source_index]
            st.units += 1
            for reason, n in u.result.skipped.items():
                st.skipped[reason] = st.skipped.get(reason, 0) + n
            if not u.result.documents:
                continue
            docs, tokens = load_docs(u.path), load_tokens(u.path, dtype)
            reps, first = repeats(docs["hash"], u.weight), seen.first_seen(docs["hash"])
            start = 0
            for (end, h), rep, new in zip(docs.tolist(), reps.tolist(), first.tolist()):
                doc, start = tokens[start:end], end
                if not new:
                    st.skipped["duplicate"] = st.skipped.get("duplicate", 0) + 1
                    continue
                val = (h < threshold or h == forced_val) and h != forced_train
                split, copies = ("val", 1) if val else ("train", rep)
                if not copies:  # a weight below 1 left it out of this data set
                    continue
                for _ in range(copies):
                    writers[split].add(doc)
                    writers[split].add(eot)
                documents[split] += 1
                st.documents += 1
                st.tokens += copies * (len(doc) + 1)
        for split, w in writers.items():
            w.flush()
            splits[split].extend(w.shards)
    return splits, documents, stats
