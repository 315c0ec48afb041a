"""Data preparation at scale (pretrain.dataset): versioned data sets, determinism across worker
counts, resuming after a kill, incremental re-runs, deduplication, weights, wide vocabularies,
an S3 root and the bad-input errors. Real files, real worker processes, a real S3 server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import wait_for
from pretrain.dataset.errors import DataPrepError
from pretrain.dataset.prepare import prepare
from pretrain.spec_data import DataSpec
from trainer.atomic import sha256_file
from trainer.data import TokenWindows, read_manifest
from trainer.data_manifest import MANIFEST

ROOT = Path(__file__).resolve().parent.parent
QUIET = {"log": lambda *_: None}


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def docs(n: int, seed: int = 0, words: int = 40) -> list[str]:
    """``n`` distinct, code-like documents (deterministic)."""
    rng = np.random.default_rng(seed)
    vocab = ["def", "return", "self", "value", "import", "json", "for", "in", "if", "else", "(", ")", ":", "x", "y"]
    return [f"# doc {seed}-{i}\n" + " ".join(rng.choice(vocab, size=words)) for i in range(n)]


def jsonl_corpus(root: Path, files: int = 3, per_file: int = 60) -> list[Path]:
    return [write_jsonl(root / f"part{k}.jsonl", docs(per_file, seed=k)) for k in range(files)]


def spec(sources, **over) -> DataSpec:
    body = {"sources": sources, "tokenizer": {"vocab_size": 300}, "val_fraction": 0.1, "shard_tokens": 4096,
            "unit_bytes": 4096, "workers": 1}
    body.update(over)
    return DataSpec.model_validate(body)


def data_set_bytes(location: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(location).iterdir())}


def test_a_prepared_data_set_is_versioned_complete_and_reused_never_rewritten(tmp_path):
    data = spec(["{stdlib}/json/*.py"], tokenizer={"vocab_size": 400}, val_fraction=0.2)
    m = prepare(data, tmp_path / "data", work=tmp_path / "work", **QUIET)
    location = Path(m["location"])
    assert location == tmp_path / "data" / m["fingerprint"] and m["reused"] is False
    on_disk = read_manifest(location)
    assert on_disk["version"] == 2 and on_disk["fingerprint"] == m["fingerprint"] and on_disk["dtype"] == "uint16"
    for split, shards in on_disk["splits"].items():
        arr = np.concatenate([np.fromfile(location / s["file"], dtype=on_disk["dtype"]) for s in shards])
        assert len(arr) == on_disk["tokens"][split] > 0 and arr.max() < on_disk["vocab_size"]
        assert all(sha256_file(location / s["file"]) == s["sha256"] for s in shards)
    assert [s["uri"].rsplit("/", 1)[1] for s in on_disk["sources"]] == sorted(s["uri"].rsplit("/", 1)[1] for s in on_disk["sources"])
    assert sum(s["documents"] for s in on_disk["sources"]) == sum(on_disk["documents"].values())
    tok = Tokenizer.from_file(str(location / on_disk["tokenizer"]))
    assert tok.decode(tok.encode('def f(x):\n    return json.dumps(x)\n').ids) == 'def f(x):\n    return json.dumps(x)\n'
    assert len(TokenWindows(location, "train", 32)) > 0  # what training reads

    before = {p.name: p.stat().st_mtime_ns for p in location.iterdir()}
    again = prepare(data, tmp_path / "data", work=tmp_path / "work", **QUIET)
    assert again["reused"] is True and again["location"] == m["location"]
    assert {p.name: p.stat().st_mtime_ns for p in location.iterdir()} == before  # not rewritten

    changed = prepare(data.model_copy(update={"val_fraction": 0.3}), tmp_path / "data", work=tmp_path / "work", **QUIET)
    assert changed["fingerprint"] != m["fingerprint"] and Path(changed["location"]).parent == location.parent
    assert {p.name: p.stat().st_mtime_ns for p in location.iterdir()} == before  # the old set stays as it was
