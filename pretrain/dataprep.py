"""The previous release's data preparation (flat ``<workdir>/data``), kept while the campaign
still calls it; :mod:`pretrain.dataset` replaces it.

Raw text → byte-level BPE tokenizer → packed token shards with a manifest.

Idempotent: the manifest records a fingerprint of the inputs (files, sizes, mtimes and the
settings); if it matches, nothing is redone. Shards are written atomically and the manifest
last, so a half-built data set is never used.
"""

from __future__ import annotations

import glob
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain.dataset.errors import DataPrepError, removed_if_disk_full  # noqa: F401 - re-exported
from pretrain.dataset.tokenizer import EOT
from pretrain.spec_data import DataSpec
from trainer.atomic import atomic_write_bytes, atomic_write_json
from trainer.data import MANIFEST, DataError, read_manifest

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class Document:
    path: str
    text: str
    group: str = "all"


def expand_sources(patterns: list[str], field: str) -> list[Path]:
    stdlib = sysconfig.get_paths()["stdlib"]
    files: list[Path] = []
    for i, pattern in enumerate(patterns):
        expanded = pattern.replace("{stdlib}", stdlib)
        matches = sorted(Path(p) for p in glob.glob(str(Path(expanded).expanduser()), recursive=True))
        matches = [m for m in matches if m.is_file()]
        if not matches:
            raise DataPrepError(f"{field}[{i}] ({pattern!r} → {expanded}) matched no files: fix the path or pattern")
        files.extend(m for m in matches if m not in files)
    return files


def select_files(data: DataSpec) -> dict[str, list[Path]]:
    """Per data group, its source files in order, up to ``max_bytes`` per group."""
    out = {}
    for group, sources in data.groups().items():
        field = "data.sources" if isinstance(data.sources, list) else f"data.sources.{group}"
        chosen, total = [], 0
        for f in expand_sources([s.path for s in sources], field):
            if data.max_bytes is not None and total >= data.max_bytes:
                break
            chosen.append(f)
            total += f.stat().st_size
        out[group] = chosen
    return out


def fingerprint(data: DataSpec, files: dict[str, list[Path]]) -> str:
    h = hashlib.sha256(json.dumps(data.model_dump(mode="json"), sort_keys=True).encode())
    for f in (f for group in files.values() for f in group):
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def read_documents(files: dict[str, list[Path]], max_bytes: int | None) -> list[Document]:
    docs = []
    for group, paths in files.items():
        total = 0
        for f in paths:
            raw = f.read_bytes()
            text = (raw if max_bytes is None else raw[: max(0, max_bytes - total)]).decode("utf-8", errors="replace")
            total += len(text)
            if text.strip():
                docs.append(Document(str(f), text, group))
    return docs


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic split by a hash of the path; at least one document on each side."""
    if len(docs) < 2:
        raise DataPrepError(f"data.sources gave {len(docs)} non-empty document(s); need at least 2 for a train/val split")
    key = lambda d: hashlib.sha256(d.path.encode()).hexdigest()  # noqa: E731
    ranked = sorted(docs, key=key)
    n_val = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
    val = {d.path for d in ranked[:n_val]}
    return [d for d in docs if d.path not in val], [d for d in docs if d.path in val]


def train_tokenizer(docs: list[Document], vocab_size: int, min_frequency: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((d.text for d in docs), trainer=trainer)
    return tok


def pack(tok: Tokenizer, docs: list[Document], eot_id: int) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return np.asarray(ids, dtype=np.uint16)


def shard_parts(split: str, tokens: np.ndarray, shard_tokens: int, group: str = "all") -> list[tuple[str, np.ndarray, str]]:
    """(file name, tokens, group) of each shard of one group's tokens."""
    stem = split if group == "all" else f"{split}_{group}"
    return [(f"{stem}_{i:05d}.bin", tokens[start : start + shard_tokens], group)
            for i, start in enumerate(range(0, len(tokens), shard_tokens))]


def pack_split(split: str, docs: list[Document], tok: Tokenizer, eot_id: int, shard_tokens: int) -> list[tuple[str, np.ndarray, str]]:
    """Pack one split, group after group (a group's windows stay contiguous), into its shards."""
    groups = sorted({d.group for d in docs})
    return [part for g in groups
            for part in shard_parts(split, pack(tok, [d for d in docs if d.group == g], eot_id), shard_tokens, g)]


def _write(path: Path, data: bytes, written: list[Path]) -> str:
    """Write one file of the data set atomically; returns its sha256."""
    digest = atomic_write_bytes(path, data)
    written.append(path)
    return digest


def _existing_manifest(out: Path, log) -> dict | None:
    """The data set already in ``out``, if any; a damaged manifest means none (prepared again)."""
    if not (out / MANIFEST).exists():
        return None
    try:
        return read_manifest(out)
    except DataError as e:
        log(f"{e}; preparing it again")
        return None


def prepare(data: DataSpec, out: Path, log=print) -> dict:
    """Build (or reuse) the data set in ``out``; returns its manifest."""
    files = select_files(data)
    fp = fingerprint(data, files)
    existing = _existing_manifest(out, log)
    if existing and existing.get("fingerprint") == fp:
        log(f"data set in {out} is up to date (fingerprint {fp}); skipping preparation")
        return {**existing, "reused": True}
    (out / MANIFEST).unlink(missing_ok=True)  # uncommit the old set before touching shards
    docs = read_documents(files, data.max_bytes)
    train_docs, val_docs = split_documents(docs, data.val_fraction)
    tok = train_tokenizer(train_docs, data.tokenizer.vocab_size, data.tokenizer.min_frequency)
    eot_id = tok.token_to_id(EOT)
    parts = {name: pack_split(name, ds, tok, eot_id, data.shard_tokens) for name, ds in (("train", train_docs), ("val", val_docs))}
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tok.to_str().encode()
    need = len(tokenizer) + sum(tokens.nbytes for ps in parts.values() for _, tokens, _ in ps)
    with removed_if_disk_full(out, need) as written:
        _write(out / TOKENIZER_FILE, tokenizer, written)
        splits = {split: [{"file": name, "tokens": int(len(tokens)), "sha256": _write(out / name, tokens.tobytes(), written),
                           "group": group} for name, tokens, group in ps] for split, ps in parts.items()}
        manifest = {
            "version": 1, "fingerprint": fp, "dtype": "uint16", "vocab_size": tok.get_vocab_size(),
            "eot_id": eot_id, "tokenizer": TOKENIZER_FILE, "splits": splits,
            "documents": {"train": len(train_docs), "val": len(val_docs)},
            "tokens": {k: sum(s["tokens"] for s in v) for k, v in splits.items()},
            "groups": {g: {k: sum(s["tokens"] for s in v if s["group"] == g) for k, v in splits.items()} for g in files},
        }
        atomic_write_json(out / MANIFEST, manifest)  # last: the data set counts from here
    log(f"prepared {manifest['tokens']['train']} train / {manifest['tokens']['val']} val tokens, "
        f"vocab {manifest['vocab_size']}, from {len(docs)} documents")
    return {**manifest, "reused": False}
