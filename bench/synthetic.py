"""A synthetic prepared data set for benchmarks that time training, not data: random tokens in
one shard with a version-1 manifest (what ``trainer.data.sampler.TokenWindows`` reads)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def token_data(directory: Path, *, vocab: int, tokens: int, seed: int = 0) -> Path:
    """``directory`` holding ``tokens`` random token ids below ``vocab`` as the train split."""
    directory.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    np.random.default_rng(seed).integers(0, vocab, tokens, dtype=dtype).tofile(directory / "train_0000.bin")
    manifest = {
        "version": 1,
        "dtype": dtype,
        "vocab_size": vocab,
        "eot_id": 0,
        "splits": {"train": [{"file": "train_0000.bin", "tokens": tokens}]},
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory
