"""Small corpora, data specs and tokenizers for the data-preparation tests (test_dataset*.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pretrain.spec.data import DataSpec

QUIET = {"log": lambda *_: None}  # prepare() without its log lines


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
    body = {
        "sources": sources,
        "tokenizer": {"vocab_size": 300},
        "val_fraction": 0.1,
        "shard_tokens": 4096,
        "unit_bytes": 4096,
        "workers": 1,
    }
    body.update(over)
    return DataSpec.model_validate(body)


def data_set_bytes(location: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(location).iterdir())}


def wide_tokenizer(path: Path, vocab: int = 70_000) -> Path:
    """A byte-level tokenizer whose separator id is above 65535 (so shards must be uint32)."""
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    ids = {ch: i for i, ch in enumerate(alphabet)}
    ids.update({f"filler{i}": len(ids) + i for i in range(vocab - len(ids) - 1)})
    tok = Tokenizer(models.BPE(vocab=ids, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path
