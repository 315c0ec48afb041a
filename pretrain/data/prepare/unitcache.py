"""The recorded result of one tokenized work unit, in ``<work>/units/<name>/``: its tokens (no
separators), each document's end offset and 64-bit hash, and its counts. A unit directory is
renamed into place complete, so one that exists is finished; one that is damaged anyway is
treated as unfinished (tokenized again), never trusted."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer.common.atomic import fsync_dir
from trainer.common.process import pid_alive

TOKENS, DOCS, META = "tokens.bin", "docs.bin", "meta.json"
DOC_DTYPE = np.dtype([("end", "<u8"), ("hash", "<u8")])  # end offset into tokens, document hash


def doc_hash(text: str) -> int:
    """The document's identity for exact deduplication and the train/val split."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def unit_dir_name(unit_key: str, tokenizer_sha256: str, read_settings: dict) -> str:
    """A unit's result depends on the unit (file identity, range, format, field), the tokenizer
    and how bad input is read; any change gives a new name, so a stale result is never reused."""
    body = json.dumps([unit_key, tokenizer_sha256, read_settings], sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:24]


@dataclass
class UnitResult:
    """Counts of one unit (what ``meta.json`` holds)."""

    documents: int = 0
    tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    skip_examples: list[str] = field(default_factory=list)  # the first few "where"s, for the log
    min_hash: int | None = None
    max_hash: int | None = None


def write_unit(final: Path, fill) -> UnitResult:
    """Build a unit's directory with ``fill(tokens_file, docs_file) -> UnitResult`` in a temporary
    directory, fsync it, and rename it to ``final`` (atomic: a kill leaves only the temporary)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with open(tmp / TOKENS, "wb") as tokens, open(tmp / DOCS, "wb") as docs:
            result = fill(tokens, docs)
            for f in (tokens, docs):
                f.flush()
                os.fsync(f.fileno())
        meta = json.dumps(result.__dict__, sort_keys=True).encode()
        with open(tmp / META, "wb") as f:
            f.write(meta)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another run finished the same unit first: same content, keep theirs
            if not final.is_dir():
                raise
        fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def read_unit_result(path: Path, itemsize: int) -> UnitResult | None:
    """The finished unit in ``path``, or None if it is absent or damaged (sizes disagree)."""
    try:
        meta = json.loads((path / META).read_bytes())
        result = UnitResult(**meta)
        ok = (path / TOKENS).stat().st_size == result.tokens * itemsize and (
            path / DOCS
        ).stat().st_size == result.documents * DOC_DTYPE.itemsize
    except (OSError, ValueError, TypeError):
        return None
    return result if ok else None


def load_docs(path: Path) -> np.ndarray:
    return np.fromfile(path / DOCS, dtype=DOC_DTYPE)


def load_tokens(path: Path, dtype: str) -> np.ndarray:
    return np.memmap(path / TOKENS, dtype=dtype, mode="r") if (path / TOKENS).stat().st_size else np.zeros(0, dtype)


def clear_stale_temporaries(units: Path) -> None:
    """Remove the temporaries a killed run left (a dot-name with the temporary mark whose
    process is gone; a live one belongs to a run still writing it)."""
    if units.is_dir():
        for p in units.iterdir():
            pid = p.name.partition(".tmp-")[2].partition("-")[0]
            if p.name.startswith(".") and pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)


def prune(units: Path, keep: set[str]) -> int:
    """Remove the finished unit results not named in ``keep`` (those of earlier corpora or
    tokenizers: their data sets are complete and never need them again); returns how many."""
    gone = 0
    for p in units.iterdir() if units.is_dir() else ():
        if not p.name.startswith(".") and p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)
            gone += 1
    return gone
